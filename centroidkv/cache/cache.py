"""The compressed KV cache: keys, values and log-degrees per layer, and the paper's budget policy.

Budget (docs/method.md, section 2; `centroidkv.cache.budget`): B entries per compressed head, R * (n + Gamma)
with `budget_unit="entries"`, or solved so that everything stored is R times a full cache of n + Gamma
tokens with "bytes" (the default). A layer is compressed to B after the prefill when n > B, and again
whenever it reaches B + g while decoding (g = `compress_interval`), at the end of its attention call
(`CompressedLayer.after_attention`): the prefill attention sees the whole prompt, and the full-size
tensors are replaced by smaller ones as soon as the layer is done. The `n_sink` first and `n_recent`
last tokens are never given to the method (shrunk for a prompt too short at the budget:
`fit_protected`; `protected_used()` says what was kept). What a method needs recorded is declared by
the method and kept by one mechanism (`centroidkv.needs`).

A layer (`CompressedLayer`, `centroidkv.cache.cache_layer`) is a list of head groups
(`centroidkv.cache.head_group`): one until the head policy (`centroidkv.head_policy`) splits the
listed heads off at the layer's first compression, kept whole or favoured. What each group does is decided from this
cache's settings, handed down as a value: on every call of a layer that needs it, the cache passes
its `planner()` (`centroidkv.cache.planner.GroupPlanner`: its settings as they are now), which turns a
group's role and its layer's state into the group's `GroupPlan` (`centroidkv.cache.group_plan`). So no
layer or group refers back up to the cache. In entries, heads kept whole are on top of B (as in the
paper); in bytes every group is paid for by the compressed heads: once per compression the planner
describes the cache's shape (`GroupPlanner.byte_shape`) and the pure
`centroidkv.cache.byte_plan.solve` turns it into B per layer. `kv_ratio()` relates `kv_bytes()` to a
full cache of the tokens seen, `budget_ratio()` to one of n + Gamma tokens.

Decoding writes in place (`centroidkv.cache.head_group`): every growing tensor is the live prefix of a
buffer with headroom, never shared between caches. `kv_bytes()` counts the live entries;
`kv_capacity_bytes()` all the storage behind them; `CompressedCache(in_place=False)` concatenates.

Two lengths are kept apart: `get_seq_length()` reports the tokens *seen* (transformers derives
position ids from it, and new tokens must keep their original positions), while the physical length
(`seq_lengths()`, `get_mask_sizes`) is what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from centroidkv.cache.budget import DEFAULT_BUDGET_UNIT, check_budget, check_budget_unit
from centroidkv.cache.byte_plan import full_entries
from centroidkv.cache.cache_layer import CompressedLayer
from centroidkv.cache.group_plan import GroupPlan
from centroidkv.cache.head_group import storage_bytes
from centroidkv.cache.planner import GroupPlanner, PlanMemo
from centroidkv.cache.quantization import StorageFormat
from centroidkv.head_policy import HeadPolicy
from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS, Need, gather_needs
from centroidkv.storage_precision import StoragePrecision

__all__ = ["CompressedCache", "CompressedLayer", "causal_allowed"]


def causal_allowed(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """[q, kv] bool: query i (the i-th of the last q tokens) may see keys 0 .. kv_len - q_len + i."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= query_pos


class CompressedCache(Cache):
    """A transformers `Cache` whose layers shrink to a budget with a compression `Method`.

    Args:
      method: a method (`get_method`'s, inside its wrappers; a bare `Method` runs as at its wrappers'
        defaults) or a registered name (then built with its defaults).
      budget: R, the fraction of (prompt + max_new_tokens) tokens each layer may keep, in (0, 1].
      max_new_tokens: Gamma, the generation length the budget accounts for.
      needs: records to keep besides the method's own (`centroidkv.needs`), so that `fork` can serve
        methods that need them (a shared prefill records the needs of every method of a job).
      in_place: decode into preallocated buffers (module docstring); False concatenates every step.
      budget_unit: "bytes" (everything stored is R times a full cache of n + Gamma tokens) or
        "entries" (B = R * (n + Gamma) entries per compressed head); `centroidkv.cache.budget`.
    """

    # The layer of a hybrid model's window layers: `centroidkv.cache.window_layer.WindowLayer`
    # registers itself here (it subclasses CompressedLayer, so this module cannot import it).
    window_layer_class: type[CompressedLayer] | None = None

    def __init__(
        self,
        method: Method | str = "centroidkv",
        budget: float = 0.25,
        max_new_tokens: int = 0,
        needs: Iterable[Need] = (),
        in_place: bool = True,
        budget_unit: str = DEFAULT_BUDGET_UNIT,
    ):
        check_budget_unit(budget_unit)
        if isinstance(method, str):
            method = get_method(method)
        check_budget(budget)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        super().__init__(layers=[])
        self.method = method
        self.budget = float(budget)
        self.max_new_tokens = max_new_tokens
        self.n_layers: int | None = None  # set by the attention hook (prepare_model)
        # each layer's rotary table (an object with `inv_freq`), set by the same hook; None: no rotary
        self.rotary: list | None = None
        self.sliding_windows: dict[int, int] = {}  # {layer: W} of a hybrid model, set by the same hook
        self.query_group: int | None = None  # query heads per KV head, set by the same hook
        self.model_ref: Callable[[], nn.Module | None] = lambda: None  # weak reference, same hook
        self.compression_enabled = True
        self.in_place = in_place
        self.budget_unit = budget_unit
        self.head_policy = HeadPolicy.of(method)  # which heads are listed, and what they keep
        self.storage: StorageFormat = StoragePrecision.of(method).storage  # how entries are stored
        self._memo = PlanMemo()  # what its planners work out once (`centroidkv.cache.planner`)
        recorded = gather_needs([*method.needs(), *needs])
        self.entry_needs = tuple(name for name in recorded if not RECORDERS[name].window)
        self.window_needs = {name: size for name, size in recorded.items() if RECORDERS[name].window}

    # --- the plans (centroidkv.cache.planner) ---------------------------------------------------------
    def planner(self) -> GroupPlanner:
        """This cache's settings as they are now, handed to a layer's call that needs plans."""
        return GroupPlanner(
            method=self.method,
            budget=self.budget,
            budget_unit=self.budget_unit,
            max_new_tokens=self.max_new_tokens,
            in_place=self.in_place,
            storage=self.storage,
            head_policy=self.head_policy,
            entry_needs=self.entry_needs,
            window_needs=tuple(self.window_needs.items()),
            compression_enabled=self.compression_enabled,
            n_layers=self.n_layers,
            rotary=self.rotary,
            sliding_windows=self.sliding_windows,
            query_group=self.query_group,
            model_ref=self.model_ref,
            memo=self._memo,
        )

    def group_plan(self, layer_idx: int, role: str | None = None) -> GroupPlan:
        """What the group of `role` (default: the compressed heads') in layer `layer_idx` does now."""
        layer = self.layers[layer_idx]
        return layer.plan(self.planner(), role or layer.main_role)

    def take_model_from(self, source: CompressedCache) -> None:
        """What the attention hook tells a cache about its model (`centroidkv.attention`), from `source`."""
        self.n_layers, self.rotary, self.model_ref = source.n_layers, source.rotary, source.model_ref
        self.sliding_windows, self.query_group = source.sliding_windows, source.query_group

    def layer(self, layer_idx: int) -> CompressedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(self.new_layer(len(self.layers)))
        return self.layers[layer_idx]

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        """An empty layer: a window layer of a hybrid model (`centroidkv.cache.window_layer`), else
        a compressed one."""
        if layer_idx in self.sliding_windows:
            return self.window_layer_class(layer_idx, self.sliding_windows[layer_idx])
        return CompressedLayer(layer_idx)

    def add_fork_of(self, layer: CompressedLayer) -> None:
        """Append, as this cache's next layer, a fork of `layer` (another cache's, same index)."""
        self.layers.append(layer.fork_into(self.new_layer(layer.layer_idx), self.planner()))

    def layer_entries(self, layer_idx: int, length: int) -> int:
        """Entries per head a full cache holds in `layer_idx` after `length` tokens: all of them, or the
        last W - 1 in a window layer (transformers' own sliding-window cache)."""
        return full_entries(self.sliding_windows.get(layer_idx), length)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ):
        """Store the new tokens in layer `layer_idx`; return its compressed heads' keys and values for
        the attention (dequantized when the storage is not the model's dtype)."""
        layer = self.layer(layer_idx)
        layer.add(self.planner(), key_states, value_states)
        return layer.read("keys"), layer.read("values")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Feed tokens without compressing (e.g. the question in the context-only protocol)."""
        previous, self.compression_enabled = self.compression_enabled, False
        try:
            yield
        finally:
            self.compression_enabled = previous

    def compress_now(self) -> None:
        """Compress every layer that is over its budget (used after `fork`)."""
        planner = self.planner()
        for layer in self.layers:
            if layer.needs_compression(planner):
                layer.compress(planner)

    def fork(
        self,
        method: Method | str,
        budget: float,
        max_new_tokens: int | None = None,
        needs: Iterable[Need] = (),
        budget_unit: str | None = None,
    ) -> CompressedCache:
        """A new cache over the same entries (shared, never modified: `centroidkv.cache.head_group`) with
        another method or budget, already compressed: how one prefill serves many runs. This cache
        must have recorded what the method needs and `needs` (records to carry along)."""
        twin = CompressedCache(
            method,
            budget,
            self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            needs,
            in_place=self.in_place,
            budget_unit=self.budget_unit if budget_unit is None else budget_unit,
        )
        twin.take_model_from(self)
        for layer in self.layers:
            twin.add_fork_of(layer)
        twin.compress_now()  # on the source's entries as they are, then in the fork's own format
        if twin.storage.precision != "model" or self.storage.precision != "model":
            planner = twin.planner()
            for layer in twin.layers:
                if layer.is_initialized:
                    layer.settle(planner)
        return twin

    def check_room(self, n_new_tokens: int) -> None:
        """Raise now, not mid-generation, when `n_new_tokens` more decoded tokens will need a compression
        whose budget holds no entry at all (known as soon as the prompt is in)."""
        planner = self.planner()
        for layer in self.layers:
            main = layer.main
            if not (self.method.compresses and layer.compresses and main.length and main.keys.shape[1]):
                continue  # as in needs_compression: nothing to compress here
            plan = layer.plan(planner, layer.main_role)
            if main.length + n_new_tokens > plan.budget_len + plan.compress_interval - 1:
                plan.protected_windows()

    def kv_bytes(self) -> int:
        """Bytes of everything the cache stores: keys, values, log-degrees, the method's entry records
        (e.g. positions) and the heads kept whole."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.stored_tensors())

    def kv_capacity_bytes(self) -> int:
        """Bytes allocated for what `kv_bytes()` counts: every storage behind it once, whole."""
        held = [t for layer in self.layers for group in layer.groups for t in group.held_tensors()]
        return storage_bytes(held)

    def full_kv_bytes(self) -> int:
        """Bytes the keys and values of every token seen would take in a full cache of the same dtype."""
        return self._full_bytes(lambda layer: layer.n_seen)

    def reference_bytes(self) -> int:
        """Bytes of the budget's reference: a full cache (keys and values, same dtype) of the prompt
        plus `max_new_tokens` tokens; R times this is what a byte budget stores."""
        return self._full_bytes(
            lambda layer: None if layer.prompt_len is None else layer.prompt_len + self.max_new_tokens
        )

    def _full_bytes(self, tokens_of: Callable[[CompressedLayer], int | None]) -> int:
        """Bytes of a full cache holding `tokens_of(layer)` tokens in each layer (None: nothing)."""
        total = 0
        for layer in self.layers:
            tokens = tokens_of(layer)
            keys = layer.main.keys
            if tokens is not None and keys is not None and keys.dim() == 4:
                batch, _, _, head_dim = keys.shape
                entries = self.layer_entries(layer.layer_idx, tokens)
                total += 2 * batch * len(layer.head_lengths()) * entries * head_dim * layer.dtype.itemsize
        return total

    def budget_ratio(self) -> float:
        """`kv_bytes()` over `reference_bytes()`: R, measured (right after a compression in bytes)."""
        reference = self.reference_bytes()
        return self.kv_bytes() / reference if reference else float("nan")

    def allocated_ratio(self) -> float:
        """`kv_capacity_bytes()` over `reference_bytes()`: the memory really allocated (the buffers'
        decode headroom included) as a fraction of the budget's reference (`budget_ratio` counts the
        live entries only)."""
        reference = self.reference_bytes()
        return self.kv_capacity_bytes() / reference if reference else float("nan")

    def kv_ratio(self) -> float:
        """Effective KV ratio: `kv_bytes()` over a full cache's bytes (what memory the budget really buys)."""
        full = self.full_kv_bytes()
        return self.kv_bytes() / full if full else float("nan")

    def seq_lengths(self) -> list[int]:
        """Stored entries per layer of its compressed heads (the physical length the budget governs, not
        the tokens seen); heads kept whole hold every token seen (`head_lengths`)."""
        return [layer.main.length for layer in self.layers]

    def head_lengths(self) -> list[list[int]]:
        """Stored entries per (layer, KV head)."""
        return [layer.head_lengths() for layer in self.layers]

    @property
    def n_compressions(self) -> int:
        return max((layer.main.n_compressions for layer in self.layers), default=0)

    def protected_used(self) -> dict[str, int | None]:
        """The protected windows the compressions kept, fewest over layers: `n_sink_used` and
        `n_recent_used` are the method's n_sink and n_recent unless a prompt too short for them at the
        budget shrank them (`centroidkv.cache.budget.fit_protected`); None before any compression."""
        used = [layer.main.protected_used for layer in self.layers if layer.main.protected_used is not None]
        if not used:
            return {"n_sink_used": None, "n_recent_used": None}
        return {"n_sink_used": min(s for s, _ in used), "n_recent_used": min(r for _, r in used)}
