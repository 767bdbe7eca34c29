"""The compressed KV cache: keys, values and log-degrees per layer, and the paper's budget policy.

Budget (docs/method.md, section 2; `centroidkv.budget`): B entries per compressed head, R * (n + Gamma)
with `budget_unit="entries"`, or solved so that everything stored is R times a full cache of n + Gamma
tokens with "bytes" (the default). A layer is compressed to B after the prefill when n > B, and again
whenever it reaches B + g while decoding (g = `compress_interval`), at the end of its attention call
(`CompressedLayer.after_attention`): the prefill attention sees the whole prompt, and the full-size
tensors are replaced by smaller ones as soon as the layer is done. The `n_sink` first and `n_recent`
last tokens are never given to the method (shrunk for a prompt too short at the budget:
`fit_protected`; `protected_used()` says what was kept). What a method needs recorded is declared by
the method and kept by one mechanism (`centroidkv.needs`).

A layer (`CompressedLayer`, `centroidkv.cache_layer`) is a list of head groups
(`centroidkv.head_group`): one until the head policy (`centroidkv.head_policy`) splits the listed heads off
at the layer's first compression, kept whole or favoured. Groups store tensors; what each does is
decided here, as a value: the cache builds a group's `GroupPlan` (`group_plan`, the one place a
group's role is read; `centroidkv.group_plan`) whenever its layer calls the group, so nothing below
the cache refers back up to it but the layer's weak reference. In entries, heads kept whole are on top
of B (as in the paper); in bytes every group is paid for by the compressed heads: once per compression
the cache describes its shape (`byte_shape`) and the pure `centroidkv.byte_plan.solve` turns it into B
per layer. `kv_ratio()` relates `kv_bytes()` to a full cache of the tokens seen, `budget_ratio()` to
one of n + Gamma tokens.

Decoding writes in place (`centroidkv.head_group`): every growing tensor is the live prefix of a
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

from centroidkv.budget import DEFAULT_BUDGET_UNIT, budget_entries, check_budget, check_budget_unit
from centroidkv.byte_plan import ByteShape, full_entries, solve
from centroidkv.cache_layer import CompressedLayer
from centroidkv.group_plan import GroupPlan
from centroidkv.head_group import storage_bytes
from centroidkv.head_policy import HeadPolicy, favoured_len
from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS, Need, gather_needs
from centroidkv.quantization import StorageFormat
from centroidkv.storage_precision import StoragePrecision

__all__ = ["CompressedCache", "CompressedLayer", "causal_allowed"]

# A head group's role: which plan its cache builds for it (`CompressedCache.group_plan`).
ROLES = ("compressed", "whole", "favoured", "window")


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
        "entries" (B = R * (n + Gamma) entries per compressed head); `centroidkv.budget`.
    """

    # The layer of a hybrid model's window layers: `centroidkv.window_layer.WindowLayer` registers itself
    # here (it subclasses CompressedLayer, so this module cannot import it).
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
        self._byte_plan: tuple[tuple[int, int], list[int]] | None = None  # (key, entries per layer)
        recorded = gather_needs([*method.needs(), *needs])
        self.entry_needs = tuple(name for name in recorded if not RECORDERS[name].window)
        self.window_needs = {name: size for name, size in recorded.items() if RECORDERS[name].window}
        self._listed: dict[int, list[int]] | None = None

    def heads_listed(self) -> dict[int, list[int]]:
        """The KV heads per layer that the method's head policy lists, asked once (needs the model:
        `prepare_model`); a window layer's heads are never listed (it is never compressed)."""
        if self._listed is None:
            listed = self.head_policy.listed_heads(self.model_ref())
            self._listed = {
                layer: heads for layer, heads in listed.items() if layer not in self.sliding_windows
            }
        return self._listed

    @property
    def listed_role(self) -> str:
        """The role of the heads the head policy lists: "whole" (heads=whole) or "favoured" (budget)."""
        return "whole" if self.head_policy.listed_whole else "favoured"

    # --- the plans (centroidkv.group_plan) -------------------------------------------------------
    def group_plan(self, layer: CompressedLayer, role: str, with_budget: bool = True) -> GroupPlan:
        """What a group of `role` in `layer` does now, from this cache's settings and the layer's state:
        the one place a role is read. `with_budget=False` leaves the budget out (a fork's layer, whose
        cache has not all its layers yet: a byte plan needs them all)."""
        if role not in ROLES:
            raise ValueError(f"a head group's role is one of {', '.join(ROLES)}, got {role!r}")
        method = self.method
        keeps_records = role in ("compressed", "favoured")
        compresses = keeps_records and method.compresses
        budget_len = self.role_budget(layer, role) if with_budget else None
        compress_above = None
        if compresses and self.compression_enabled and budget_len is not None:
            decoding = layer.n_seen > layer.prompt_len  # let g tokens accumulate before re-compressing
            compress_above = budget_len + (method.compress_interval - 1 if decoding else 0)
        return GroupPlan(
            storage=StorageFormat() if role == "window" else self.storage,  # window layers: model dtype
            in_place=self.in_place,
            keeps_records=keeps_records,
            entry_records=self.entry_needs if keeps_records else (),
            window_records=tuple(self.window_needs.items()) if keeps_records else (),
            budget_len=budget_len,
            compress_above=compress_above,
            compresses=compresses,
            compress_interval=method.compress_interval,
            max_new_tokens=self.max_new_tokens,
            window=layer.window if role == "window" else None,
            method=method,
            n_sink=method.n_sink,
            n_recent=method.n_recent,
            merges=method.merges,
            label=method.name,
        )

    def role_budget(self, layer: CompressedLayer, role: str) -> int | None:
        """Entries per head a group of `role` in `layer` is compressed to: B ("compressed"),
        heads_boost x B ("favoured"), a window layer's W - 1; None for heads kept whole, or before
        the prompt."""
        if layer.prompt_len is None or role == "whole":
            return None
        if role == "window":
            return layer.window - 1
        budget = self.layer_budget_len(layer)
        if role == "favoured":
            return favoured_len(budget, self.head_policy.heads_boost, layer.prompt_len + self.max_new_tokens)
        return budget

    # --- the budget (module docstring; centroidkv.budget) -------------------------------------------
    def layer_budget_len(self, layer: CompressedLayer) -> int:
        """B for `layer`: entries per compressed head, in the cache's budget unit."""
        if self.budget_unit == "entries" or not self.method.compresses:
            entries = budget_entries(self.budget, layer.prompt_len, self.max_new_tokens)
            budget = self.method.layer_budget(entries, layer.layer_idx, self.n_layers)
        else:
            if self._byte_plan is None:
                self.plan_budget(layer)
            budget = self._byte_plan[1][layer.layer_idx]
        return budget

    def plan_budget(self, layer: CompressedLayer) -> None:
        """In bytes, solve every layer's B for what is stored when `layer` compresses. Listed heads
        (kept whole, or favoured below their own budget) grow while decoding, so the plan is solved
        again at a compression that sees more tokens; between compressions it holds (the cache then
        grows to B + g, as with entries)."""
        if self.budget_unit != "bytes" or not self.method.compresses:
            return
        key = (layer.prompt_len, layer.n_seen if self.heads_listed() else 0)
        if self._byte_plan is None or self._byte_plan[0] != key:
            self._byte_plan = (key, solve(self.byte_shape(layer)))

    def byte_shape(self, layer: CompressedLayer) -> ByteShape:
        """What the byte plan depends on when `layer` compresses (`centroidkv.byte_plan.ByteShape`)."""
        batch, _, _, head_dim = layer.keys.shape
        method, listed, n_layers = self.method, self.heads_listed(), self.n_layers
        return ByteShape(
            batch=batch,
            n_heads=len(layer.head_lengths()),  # every KV head of a layer
            head_dim=head_dim,
            itemsize=layer.dtype.itemsize,
            n_records=len(self.entry_needs) + (1 if method.merges else 0),  # + the log-degree
            storage=self.storage,
            listed=tuple(len(listed.get(index, ())) for index in range(n_layers)),
            listed_whole=self.head_policy.listed_whole,
            heads_boost=self.head_policy.heads_boost,
            windows=tuple(self.sliding_windows.get(index) for index in range(n_layers)),
            n_seen=layer.n_seen,
            prompt_len=layer.prompt_len,
            max_new_tokens=self.max_new_tokens,
            budget=self.budget,
            # (the model's query group: a plan solved before the first attention call knows it too)
            query_group=self.query_group or layer.query_group,
            window_records=sum(self.window_needs.values()),
            layer_budget=method.layer_budget,
            method_name=method.name,
        )

    def take_model_from(self, source: CompressedCache) -> None:
        """What the attention hook tells a cache about its model (`centroidkv.attention`), from `source`."""
        self.n_layers, self.rotary, self.model_ref = source.n_layers, source.rotary, source.model_ref
        self.sliding_windows, self.query_group = source.sliding_windows, source.query_group

    def layer(self, layer_idx: int) -> CompressedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(self.new_layer(len(self.layers)))
        return self.layers[layer_idx]

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        """An empty layer: a window layer of a hybrid model (`centroidkv.window_layer`), else compressed."""
        if layer_idx in self.sliding_windows:
            return self.window_layer_class(self, layer_idx, self.sliding_windows[layer_idx])
        return CompressedLayer(self, layer_idx)

    def layer_entries(self, layer_idx: int, length: int) -> int:
        """Entries per head a full cache holds in `layer_idx` after `length` tokens: all of them, or the
        last W - 1 in a window layer (transformers' own sliding-window cache)."""
        return full_entries(self.sliding_windows.get(layer_idx), length)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ):
        return self.layer(layer_idx).update(key_states, value_states, cache_kwargs)

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
        for layer in self.layers:
            if layer.needs_compression():
                layer.compress()

    def fork(
        self,
        method: Method | str,
        budget: float,
        max_new_tokens: int | None = None,
        needs: Iterable[Need] = (),
        budget_unit: str | None = None,
    ) -> CompressedCache:
        """A new cache over the same entries (shared, never modified: `centroidkv.head_group`) with
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
        twin.layers = [layer.fork(twin) for layer in self.layers]
        twin.compress_now()  # on the source's entries as they are, then in the fork's own format
        if twin.storage.precision != "model" or self.storage.precision != "model":
            for layer in twin.layers:
                if layer.is_initialized:
                    layer.settle()
        return twin

    def check_room(self, n_new_tokens: int) -> None:
        """Raise now, not mid-generation, when `n_new_tokens` more decoded tokens will need a compression
        whose budget holds no entry at all (known as soon as the prompt is in)."""
        for layer in self.layers:
            if not (self.method.compresses and layer.compresses and layer.length and layer.keys.shape[1]):
                continue  # as in needs_compression: nothing to compress here
            plan = layer.plan(layer.main_role)
            if layer.length + n_new_tokens > plan.budget_len + plan.compress_interval - 1:
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
            if tokens is not None and layer.keys is not None and layer.keys.dim() == 4:
                batch, _, _, head_dim = layer.keys.shape
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
        return [layer.length for layer in self.layers]

    def head_lengths(self) -> list[list[int]]:
        """Stored entries per (layer, KV head)."""
        return [layer.head_lengths() for layer in self.layers]

    @property
    def n_compressions(self) -> int:
        return max((layer.n_compressions for layer in self.layers), default=0)

    def protected_used(self) -> dict[str, int | None]:
        """The protected windows the compressions kept, fewest over layers: `n_sink_used` and
        `n_recent_used` are the method's n_sink and n_recent unless a prompt too short for them at the
        budget shrank them (`centroidkv.budget.fit_protected`); None before any compression."""
        used = [layer.protected_used for layer in self.layers if layer.protected_used is not None]
        if not used:
            return {"n_sink_used": None, "n_recent_used": None}
        return {"n_sink_used": min(s for s, _ in used), "n_recent_used": min(r for _, r in used)}
