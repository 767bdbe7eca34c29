"""One layer of a compressed cache: its head groups, and when they store, record and compress.

A layer (`CompressedLayer`) is a list of head groups (`centroidkv.head_group`): one until the head
policy (`centroidkv.head_policy`) splits the listed heads off at the layer's first compression. It is what
transformers and the attention function talk to: it routes each group its heads' new tokens and
queries, decides when a group is over its budget, and splits the heads. What each group should do
(its budget, storage format, records) is its cache's decision: the layer asks its cache for a
`GroupPlan` (`centroidkv.group_plan`) on every call that needs one and hands it to the group, so
groups refer to nothing above them. The layer refers to its cache weakly, and only through what
`LayerOwner` lists: the cache (`centroidkv.cache.CompressedCache`) imports this module, not the other
way round.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from centroidkv.group_plan import GroupPlan
from centroidkv.head_group import HeadGroup, storage_bytes
from centroidkv.kv import LayerStats


class LayerOwner(Protocol):
    """What a layer reads from its cache (`centroidkv.cache.CompressedCache`)."""

    n_layers: int | None  # set when the cache meets a prepared model
    rotary: list | None  # each layer's rotary table, or None
    compression_enabled: bool
    listed_role: str  # the role of the heads the head policy lists ("whole" or "favoured")

    def group_plan(self, layer: CompressedLayer, role: str, with_budget: bool = True) -> GroupPlan: ...

    def plan_budget(self, layer: CompressedLayer) -> None: ...

    def heads_listed(self) -> dict[int, list[int]]: ...

    def new_layer(self, layer_idx: int) -> CompressedLayer: ...


class CompressedLayer(DynamicLayer):
    """One layer of the cache: a list of head groups (`centroidkv.head_group`), the first of which
    (`main`) holds the heads compressed to B; the others, once the method's head policy splits the
    layer, hold the listed heads (kept whole, or favoured with a larger budget)."""

    compresses = True  # False for a hybrid model's window layers (`centroidkv.window_layer`)
    main_role = "compressed"
    window: int | None = None  # a window layer's W (`centroidkv.window_layer`)

    def __init__(self, owner: LayerOwner, layer_idx: int):
        self.groups = [HeadGroup(self.main_role)]
        super().__init__()
        # A weak reference: a strong one would make cache <-> layer a reference cycle, and every
        # dropped cache (one per fork) would hold its tensors until Python's cycle collector runs.
        # (Groups refer to nothing: their layer hands them their plans.)
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.scaling: float = 1.0
        self.query_group = 1  # query heads per KV head (set by the first attention call)
        self.n_seen = 0  # tokens this layer has seen (positions), not what it stores
        self.prompt_len: int | None = None  # length of the first update (the prefill)

    @property
    def owner(self) -> LayerOwner:
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
    budget_len = property(lambda self: self.plan(self.main_role).budget_len, doc="B, once the prompt is in.")
    tracks_attention = property(lambda self: self.main.tracks_attention)
    n_compressions = property(lambda self: self.main.n_compressions)
    protected_used = property(lambda self: self.main.protected_used)
    attention_sum = property(lambda self: self.main.extras.get("attention_sum"), doc="[B, H, T] or None.")
    queries = property(lambda self: self.main.windows.get("queries"), doc="The last queries, or None.")
    split = property(lambda self: self.main.heads is not None, doc="Whether the head policy split the heads.")

    def group(self, role: str) -> HeadGroup | None:
        """The group of `role` ("whole", "favoured"), None when the layer has none."""
        return next((group for group in self.groups if group.role == role), None)

    # --- the plans (centroidkv.group_plan) -------------------------------------------------------
    def plan(self, role: str, with_budget: bool = True) -> GroupPlan:
        """What a group of `role` does now (`CompressedCache.group_plan`)."""
        return self.owner.group_plan(self, role, with_budget)

    def stats(self) -> LayerStats:
        """What a method may read besides a group's entries: this layer, its scaling, its rotary table
        (the windows are each group's own: `HeadGroup.compress` adds them)."""
        cache = self.owner
        rotary = cache.rotary[self.layer_idx] if cache.rotary else None
        return LayerStats(self.layer_idx, cache.n_layers, self.scaling, rotary=rotary)

    # --- storing tokens --------------------------------------------------------------------------
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
            keys, values = key_states, value_states
            if group.heads is not None:
                keys, values = key_states[:, group.heads], value_states[:, group.heads]
            group.add(keys, values, self.n_seen, self.plan(group.role))
        self.n_seen += key_states.shape[2]
        if self.prompt_len is None:
            self.prompt_len = key_states.shape[2]
            self.check_planned_room()

    def settle(self) -> None:
        """Bring every group to its plan's storage format (`HeadGroup.settle`)."""
        for group in self.groups:
            group.settle(self.plan(group.role))

    def check_planned_room(self) -> None:
        """Raise now (one line) when the generation this cache was planned for (the prompt plus
        `max_new_tokens`) will need a compression whose budget holds no entry at all,
        instead of failing at that compression, possibly many tokens later."""
        plan = self.plan(self.main_role, with_budget=False)
        if not plan.compresses or not self.owner.compression_enabled:
            return
        budget, planned = self.budget_len, self.prompt_len + max(0, plan.max_new_tokens - 1)
        if self.prompt_len > budget or planned > budget + plan.compress_interval - 1:
            self.check_protected_fit()

    def check_protected_fit(self) -> None:
        """Raise (one line) when this layer's budget holds no entry at all; a budget below the protected
        windows shrinks them instead (`GroupPlan.protected_windows`)."""
        self.plan(self.main_role).protected_windows()

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
            plan = self.plan(group.role)
            group.record(query, got, plan)
            if group is not self.main and group.needs_compression(plan):
                self.owner.plan_budget(self)  # in bytes: what the other groups hold now
                group.compress(self.plan(group.role), self.stats())
        # `plan` is the main group's: the loop's last, built after any other group compressed
        if self.main.needs_compression(plan):
            self.compress()

    def needs_compression(self) -> bool:
        return self.main.needs_compression(self.plan(self.main_role))

    def compress(self) -> None:
        """Shrink the layer to its budget; at its first compression, split the heads its method's head
        policy lists into their own group (then compressed to its own budget, or kept whole)."""
        cache = self.owner
        cache.plan_budget(self)  # in bytes: solved for what every group holds now, once
        listed = cache.heads_listed().get(self.layer_idx)
        if listed and not self.split:
            self.split_heads(listed)
            listed_group = self.groups[1]
            plan = self.plan(listed_group.role)
            if plan.compresses:  # favoured heads: compressed to their own budget right away
                listed_group.compress(plan, self.stats())
        self.main.compress(self.plan(self.main_role), self.stats())

    def split_heads(self, listed: list[int]) -> None:
        """Move the KV heads `listed` into a group of their own (`CompressedCache.listed_role`): kept
        whole from now on (heads=whole) or compressed to heads_boost x B (heads=budget)."""
        main, n_heads = self.main, self.main.n_heads
        if any(not 0 <= head < n_heads for head in listed):
            raise ValueError(f"layer {self.layer_idx}: listed heads {listed} outside 0..{n_heads - 1}")
        device = self.keys.device
        other = torch.tensor(sorted(listed), dtype=torch.long, device=device)
        rest = torch.tensor([h for h in range(n_heads) if h not in listed], dtype=torch.long, device=device)
        role = self.owner.listed_role
        self.groups = [
            main.select(self.main_role, rest, n_heads, self.plan(self.main_role)),
            main.select(role, other, n_heads, self.plan(role)),
        ]

    def fork(self, owner: LayerOwner) -> CompressedLayer:
        """A layer for another cache that shares this one's tensors (never modified in place), with
        only the records `owner` asks for."""
        twin = owner.new_layer(self.layer_idx)
        for attr in ("scaling", "query_group", "n_seen", "prompt_len", "is_initialized", "dtype", "device"):
            setattr(twin, attr, getattr(self, attr))
        twin.groups = [
            # a split layer's compressed heads were compressed at the split: not the tokens as seen
            group.fork(
                twin.plan(group.role, with_budget=False),
                group.length == self.n_seen and not (self.split and group is self.main),
            )
            for group in self.groups
        ]
        return twin
