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

A layer (`CompressedLayer`) is a list of head groups (`centroidkv.head_group`): one until the head
policy (`centroidkv.heads`) splits the listed heads off at the layer's first compression, kept whole or
favoured. In entries, heads kept whole are on top of B (as in the paper); in bytes
(`centroidkv.byte_plan`: a pure function of the shape the cache describes, `byte_shape`) every
group is paid for by the compressed heads. `kv_ratio()` relates
`kv_bytes()` to a full cache of the tokens seen, `budget_ratio()` to one of n + Gamma tokens.

Decoding writes in place (`centroidkv.head_group`): every growing tensor is the live prefix of a
buffer with headroom, never shared between caches. `kv_bytes()` counts the live entries;
`kv_capacity_bytes()` all the storage behind them; `CompressedCache(in_place=False)` concatenates.

Two lengths are kept apart: `get_seq_length()` reports the tokens *seen* (transformers derives
position ids from it, and new tokens must keep their original positions), while the physical length
(`seq_lengths()`, `get_mask_sizes`) is what is stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicLayer

from centroidkv.budget import (
    DEFAULT_BUDGET_UNIT,
    budget_entries,
    check_budget,
    check_budget_unit,
)
from centroidkv.byte_plan import ByteShape, full_entries, solve
from centroidkv.head_group import HeadGroup, storage_bytes
from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS, Need, gather_needs
from centroidkv.quantization import StorageFormat


class CompressedLayer(DynamicLayer):
    """One layer of the cache: a list of head groups (`centroidkv.head_group`), the first of which
    (`main`) holds the heads compressed to B; the others, once the method's head policy splits the
    layer, hold the listed heads (kept whole, or favoured with a larger budget)."""

    compresses = True  # False for a hybrid model's window layers (`centroidkv.window_layer`)
    main_role = "compressed"

    def __init__(self, owner: CompressedCache, layer_idx: int):
        self.groups = [HeadGroup(self, self.main_role)]
        super().__init__()
        # A weak reference: a strong one would make cache <-> layer a reference cycle, and every
        # dropped cache (one per fork) would hold its tensors until Python's cycle collector runs.
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.scaling: float = 1.0
        self.query_group = 1  # query heads per KV head (set by the first attention call)
        self.n_seen = 0  # tokens this layer has seen (positions), not what it stores
        self.prompt_len: int | None = None  # length of the first update (the prefill)

    @property
    def owner(self) -> CompressedCache:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("this cache layer outlived its CompressedCache")
        return owner

    # What transformers' layer interface and the methods read: the main group's entries.
    main = property(lambda self: self.groups[0], doc="The group compressed to B (every head before a split).")
    keys = property(lambda self: self.main.keys, lambda self, value: setattr(self.main, "keys", value))
    values = property(lambda self: self.main.values, lambda self, value: setattr(self.main, "values", value))
    log_degree = property(lambda self: self.main.log_degree)
    extras = property(lambda self: self.main.extras)
    windows = property(lambda self: self.main.windows)
    packed = property(lambda self: self.main.packed)
    length = property(lambda self: self.main.length, doc="Entries per compressed head.")
    budget_len = property(lambda self: self.main.budget_len, doc="B for this layer, once the prompt is in.")
    tracks_attention = property(lambda self: self.main.tracks_attention)
    n_compressions = property(lambda self: self.main.n_compressions)
    protected_used = property(lambda self: self.main.protected_used)
    attention_sum = property(lambda self: self.main.extras.get("attention_sum"), doc="[B, H, T] or None.")
    queries = property(lambda self: self.main.windows.get("queries"), doc="The last queries, or None.")
    split = property(lambda self: self.main.heads is not None, doc="Whether the head policy split the heads.")

    def group(self, role: str) -> HeadGroup | None:
        """The group of `role` ("whole", "favoured"), None when the layer has none."""
        return next((group for group in self.groups if group.role == role), None)

    def read(self, slot: str) -> Tensor:
        return self.main.read(slot)

    def degrees_or_zeros(self) -> Tensor:
        return self.main.degrees_or_zeros()

    def update(self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None):
        """Store the new tokens; return the compressed heads' keys and values for the attention
        (dequantized when the storage is not the model's dtype)."""
        self.add(key_states, value_states)
        return self.read("keys"), self.read("values")

    def add(self, key_states: Tensor, value_states: Tensor) -> None:
        """Store the new tokens' keys and values [B, H, q, D] (and their records), each group its heads."""
        if self.owner.n_layers is None:
            raise RuntimeError(
                "CompressedCache needs a model prepared by centroidkv: load it with centroidkv.load_model, "
                "or call centroidkv.prepare_model(model) once after loading it yourself (its attention adds "
                "log-degrees and triggers compression)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for group in reversed(self.groups):  # the listed heads' groups first, as they were split off
            if group.heads is None:
                group.add(key_states, value_states, self.n_seen)
            else:
                group.add(key_states[:, group.heads], value_states[:, group.heads], self.n_seen)
        self.n_seen += key_states.shape[2]
        if self.prompt_len is None:
            self.prompt_len = key_states.shape[2]
            self.check_planned_room()

    def settle(self) -> None:
        """Bring every group to the cache's storage format (`HeadGroup.settle`)."""
        for group in self.groups:
            group.settle()

    def check_planned_room(self) -> None:
        """Raise now (one line) when the generation this cache was planned for (the prompt plus
        `max_new_tokens`) will need a compression whose budget holds no entry at all,
        instead of failing at that compression, possibly many tokens later."""
        method = self.owner.method
        if not method.compresses or not self.owner.compression_enabled:
            return
        budget, planned = self.budget_len, self.prompt_len + max(0, self.owner.max_new_tokens - 1)
        if self.prompt_len > budget or planned > budget + method.compress_interval - 1:
            self.check_protected_fit()

    def check_protected_fit(self) -> None:
        """Raise (one line) when this layer's budget holds no entry at all; a budget below the protected
        windows shrinks them instead (`HeadGroup.protected_windows`)."""
        self.main.protected_windows()

    def capacity_bytes(self) -> int:
        """Bytes allocated behind this layer's stored tensors (`centroidkv.head_group.storage_bytes`)."""
        return storage_bytes([tensor for group in self.groups for tensor in group.held_tensors()])

    def stored_tensors(self) -> list[Tensor]:
        """Everything this layer stores for its method, over its groups: entries, degrees, records,
        window records (e.g. SnapKV's query window) and the ids of the heads of each group."""
        return [tensor for group in self.groups for tensor in group.stored_tensors()]

    def head_lengths(self) -> list[int]:
        """Entries per KV head, in head order."""
        if not self.split:
            return [self.length] * self.main.n_heads
        lengths = [0] * sum(len(group.heads) for group in self.groups)
        for group in self.groups:
            for head in group.heads.tolist():
                lengths[head] = group.length
        return lengths

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_mask_sizes(self, cache_position: Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a compressed cache cannot be cropped (positions no longer map to entries)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn) -> None:
        for group in self.groups:
            group.map_batch(fn)

    # --- attention and compression ---------------------------------------------------------------
    def after_attention(
        self,
        queries: list[Tensor] | Tensor,
        scaling: float,
        received: list[Tensor | None] | Tensor | None = None,
    ) -> None:
        """Called by the attention function once this layer's attention output is computed, with each
        group's queries [B, H_q, q, D] and the attention each of its entries received ([B, H_g, T],
        computed alongside the output when the group tracks attention); one tensor each for a layer
        that is not split. The listed heads' groups record (and compress) first, then the main one."""
        if not isinstance(queries, list):
            queries, received = [queries], [received]
        self.scaling = scaling
        if not self.split and self.main.n_heads:
            self.query_group = queries[0].shape[1] // self.main.n_heads
        for group, query, got in reversed(list(zip(self.groups, queries, received, strict=True))):
            group.record(query, got)
            if group is not self.main and group.needs_compression():
                group.compress()
        if self.needs_compression():
            self.compress()

    def needs_compression(self) -> bool:
        return self.main.needs_compression()

    def compress(self) -> None:
        """Shrink the layer to its budget; at its first compression, split the heads its method's head
        policy lists into their own group (then compressed to its own budget, or kept whole)."""
        self.owner.plan_budget(self)  # in bytes: what the heads kept whole hold now
        listed = self.owner.heads_listed().get(self.layer_idx)
        if listed and not self.split:
            self.split_heads(listed, self.owner.method.heads)
            favoured = self.group("favoured")
            if favoured is not None and favoured.length > favoured.budget_len:
                favoured.compress()
        self.main.compress()

    def split_heads(self, listed: list[int], policy: str) -> None:
        """Move the KV heads `listed` into a group of their own: kept whole from now on (policy
        "whole") or compressed to heads_boost x B ("budget")."""
        main, n_heads = self.main, self.main.n_heads
        if any(not 0 <= head < n_heads for head in listed):
            raise ValueError(f"layer {self.layer_idx}: listed heads {listed} outside 0..{n_heads - 1}")
        device = self.keys.device
        other = torch.tensor(sorted(listed), dtype=torch.long, device=device)
        rest = torch.tensor([h for h in range(n_heads) if h not in listed], dtype=torch.long, device=device)
        role = "whole" if policy == "whole" else "favoured"
        self.groups = [
            main.select(self, "compressed", rest, n_heads),
            main.select(self, role, other, n_heads),
        ]

    def fork(self, owner: CompressedCache) -> CompressedLayer:
        """A layer for another cache that shares this one's tensors (never modified in place), with
        only the records `owner` asks for."""
        twin = owner.new_layer(self.layer_idx)
        for attr in ("scaling", "query_group", "n_seen", "prompt_len", "is_initialized", "dtype", "device"):
            setattr(twin, attr, getattr(self, attr))
        twin.groups = [group.fork(twin, self.split) for group in self.groups]
        return twin


def causal_allowed(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """[q, kv] bool: query i (the i-th of the last q tokens) may see keys 0 .. kv_len - q_len + i."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= query_pos


class CompressedCache(Cache):
    """A transformers `Cache` whose layers shrink to a budget with a compression `Method`.

    Args:
      method: a `Method` instance or a registered name (then built with its defaults).
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
        self.storage: StorageFormat = method.storage  # how keys and values are stored (quantization)
        self._byte_plan: tuple[tuple[int, int], list[int]] | None = None  # (key, entries per layer)
        recorded = gather_needs([*method.needs(), *needs])
        self.entry_needs = [name for name in recorded if not RECORDERS[name].window]
        self.window_needs = {name: size for name, size in recorded.items() if RECORDERS[name].window}
        self._listed: dict[int, list[int]] | None = None

    def heads_listed(self) -> dict[int, list[int]]:
        """The KV heads per layer that the method's head policy lists, asked once (needs the model:
        `prepare_model`); a window layer's heads are never listed (it is never compressed)."""
        if self._listed is None:
            listed = self.method.listed_heads(self.model_ref())
            self._listed = {
                layer: heads for layer, heads in listed.items() if layer not in self.sliding_windows
            }
        return self._listed

    def heads_kept_whole(self) -> dict[int, list[int]]:
        """The listed heads when they are kept whole (heads=whole), else none."""
        return self.heads_listed() if self.method.heads == "whole" else {}

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
            listed_whole=method.heads == "whole",
            heads_boost=method.heads_boost,
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
            if layer.length + n_new_tokens > layer.budget_len + self.method.compress_interval - 1:
                layer.check_protected_fit()

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
