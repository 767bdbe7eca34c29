"""One layer of a compressed cache: its head groups, and when they store, record and compress.

A layer (`CompressedLayer`) is a list of head groups (`centroidkv.cache.head_group`): one until the
head policy (`centroidkv.head_policy`) splits the listed heads off at the layer's first compression.
It routes each group its heads' new tokens and queries, decides when a group is over its budget,
and splits the heads. What each group should do (its budget, storage format, records) is its
cache's decision: the cache hands the layer a `GroupPlanner` (`centroidkv.cache.planner`) as an
argument of every call that needs plans, the layer asks it for each group's `GroupPlan`
(`centroidkv.cache.group_plan`) with its own state as a value (`state`), and hands the plan to the
group. So a layer holds no reference to its cache, nor a group to its layer: the cache
(`centroidkv.cache.cache.CompressedCache`) imports this module, and nothing here calls back up.

The entries are the groups' (`main.keys`, `group("whole").keys`, ...); the layer's own `keys` and
`values` are transformers' layer interface, for the libraries that use it (kvpress): the main group's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from centroidkv.cache.group_plan import GroupPlan
from centroidkv.cache.head_group import HeadGroup, storage_bytes
from centroidkv.cache.planner import GroupPlanner, LayerState
from centroidkv.kv import LayerStats


class CompressedLayer(DynamicLayer):
    """One layer of the cache: a list of head groups (`centroidkv.cache.head_group`), the first of
    which (`main`) holds the heads compressed to B; the others, once the method's head policy splits the
    layer, hold the listed heads (kept whole, or favoured with a larger budget)."""

    compresses = True  # False for a hybrid model's window layers (`centroidkv.cache.window_layer`)
    main_role = "compressed"
    window: int | None = None  # a window layer's W (`centroidkv.cache.window_layer`)

    def __init__(self, layer_idx: int):
        self.groups = [HeadGroup(self.main_role)]
        super().__init__()  # (sets `keys` and `values`: the main group's, below)
        self.layer_idx = layer_idx
        self.scaling: float = 1.0
        self.query_group = 1  # query heads per KV head (set by the first attention call)
        self.n_seen = 0  # tokens this layer has seen (positions), not what it stores
        self.prompt_len: int | None = None  # length of the first update (the prefill)

    @property
    def main(self) -> HeadGroup:
        """The group compressed to B (every head before a split)."""
        return self.groups[0]

    def is_split(self) -> bool:
        """Whether the head policy split the heads into groups."""
        return self.main.heads is not None

    def group(self, role: str) -> HeadGroup | None:
        """The group of `role` ("whole", "favoured"), None when the layer has none."""
        return next((group for group in self.groups if group.role == role), None)

    # --- the plans (centroidkv.cache.planner) ----------------------------------------------------------
    def state(self) -> LayerState:
        """What its planner reads about this layer (`centroidkv.cache.planner.LayerState`)."""
        keys = self.main.keys
        if keys is None or keys.dim() < 4:
            return LayerState(self.layer_idx, self.prompt_len, self.n_seen, self.window, self.query_group)
        batch, _, _, head_dim = keys.shape
        n_heads = sum(group.n_heads for group in self.groups)
        return LayerState(
            self.layer_idx,
            self.prompt_len,
            self.n_seen,
            self.window,
            self.query_group,
            batch=batch,
            n_heads=n_heads,
            head_dim=head_dim,
            itemsize=self.dtype.itemsize,
        )

    def plan(self, planner: GroupPlanner, role: str, with_budget: bool = True) -> GroupPlan:
        """What a group of `role` does now (`GroupPlanner.group_plan`)."""
        return planner.group_plan(self.state(), role, with_budget)

    # transformers' layer interface (`CacheLayerMixin.keys` and `values`), which kvpress's presses
    # read and replace: the compressed heads' entries, which the main group holds.
    @property
    def keys(self) -> Tensor | None:
        return self.main.keys

    @keys.setter
    def keys(self, keys: Tensor | None) -> None:
        self.main.keys = keys

    @property
    def values(self) -> Tensor | None:
        return self.main.values

    @values.setter
    def values(self, values: Tensor | None) -> None:
        self.main.values = values

    # --- storing tokens --------------------------------------------------------------------------
    def read(self, slot: str) -> Tensor:
        """The compressed heads' `slot` ("keys" or "values") in the model's dtype (`HeadGroup.read`)."""
        return self.main.read(slot)

    def update(self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None):
        raise TypeError("a compressed layer is updated through its cache (`CompressedCache.update`)")

    def add(self, planner: GroupPlanner, key_states: Tensor, value_states: Tensor) -> None:
        """Store the new tokens' keys and values [B, H, q, D] (and their records), each group its heads."""
        if planner.n_layers is None:
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
            group.add(keys, values, self.n_seen, self.plan(planner, group.role))
        self.n_seen += key_states.shape[2]
        if self.prompt_len is None:
            self.prompt_len = key_states.shape[2]
            self.check_planned_room(planner)

    def settle(self, planner: GroupPlanner) -> None:
        """Bring every group to its plan's storage format (`HeadGroup.settle`)."""
        for group in self.groups:
            group.settle(self.plan(planner, group.role))

    def check_planned_room(self, planner: GroupPlanner) -> None:
        """Raise now (one line) when the generation this cache was planned for (the prompt plus
        `max_new_tokens`) will need a compression whose budget holds no entry at all,
        instead of failing at that compression, possibly many tokens later."""
        if not planner.compression_enabled or not self.plan(planner, self.main_role, False).compresses:
            return
        plan = self.plan(planner, self.main_role)  # (its budget: solved only for a layer that compresses)
        budget, planned = plan.budget_len, self.prompt_len + max(0, plan.max_new_tokens - 1)
        if self.prompt_len > budget or planned > budget + plan.compress_interval - 1:
            plan.protected_windows()  # raises when the budget holds no entry; else shrinks them

    def capacity_bytes(self) -> int:
        """Bytes allocated behind this layer's stored tensors (`head_group.storage_bytes`)."""
        return storage_bytes([tensor for group in self.groups for tensor in group.held_tensors()])

    def stored_tensors(self) -> list[Tensor]:
        """Everything this layer stores for its method, over its groups: entries, degrees, records,
        window records (e.g. SnapKV's query window) and the ids of the heads of each group."""
        return [tensor for group in self.groups for tensor in group.stored_tensors()]

    def head_lengths(self) -> list[int]:
        """Entries per KV head, in head order."""
        if not self.is_split():
            return [self.main.length] * self.main.n_heads
        lengths = [0] * sum(len(group.heads) for group in self.groups)
        for group in self.groups:
            for head in group.heads.tolist():
                lengths[head] = group.length
        return lengths

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_mask_sizes(self, cache_position: Tensor) -> tuple[int, int]:
        return self.main.length + cache_position.shape[0], 0

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
        planner: GroupPlanner,
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
        if not self.is_split() and self.main.n_heads:
            self.query_group = queries[0].shape[1] // self.main.n_heads
        for group, query, got in reversed(list(zip(self.groups, queries, received, strict=True))):
            plan = self.plan(planner, group.role)
            group.record(query, got, plan)
            if group is not self.main and group.needs_compression(plan):
                planner.solve_budget(self.state())  # in bytes: what the other groups hold now
                group.compress(self.plan(planner, group.role), self.stats(planner))
        # `plan` is the main group's: the loop's last, built after any other group compressed
        if self.main.needs_compression(plan):
            self.compress(planner)

    def stats(self, planner: GroupPlanner) -> LayerStats:
        """What a method may read besides a group's entries (`GroupPlanner.stats`)."""
        return planner.stats(self.layer_idx, self.scaling)

    def needs_compression(self, planner: GroupPlanner) -> bool:
        return self.main.needs_compression(self.plan(planner, self.main_role))

    def compress(self, planner: GroupPlanner) -> None:
        """Shrink the layer to its budget; at its first compression, split the heads its method's head
        policy lists into their own group (then compressed to its own budget, or kept whole)."""
        planner.solve_budget(self.state())  # in bytes: solved for what every group holds now, once
        listed = planner.heads_listed().get(self.layer_idx)
        if listed and not self.is_split():
            self.split_heads(planner, listed)
            listed_group = self.groups[1]
            plan = self.plan(planner, listed_group.role)
            if plan.compresses:  # favoured heads: compressed to their own budget right away
                listed_group.compress(plan, self.stats(planner))
        self.main.compress(self.plan(planner, self.main_role), self.stats(planner))

    def split_heads(self, planner: GroupPlanner, listed: list[int]) -> None:
        """Move the KV heads `listed` into a group of their own (`GroupPlanner.listed_role`): kept
        whole from now on (heads=whole) or compressed to heads_boost x B (heads=budget)."""
        main, n_heads = self.main, self.main.n_heads
        if any(not 0 <= head < n_heads for head in listed):
            raise ValueError(f"layer {self.layer_idx}: listed heads {listed} outside 0..{n_heads - 1}")
        device = main.keys.device
        other = torch.tensor(sorted(listed), dtype=torch.long, device=device)
        rest = torch.tensor([h for h in range(n_heads) if h not in listed], dtype=torch.long, device=device)
        role = planner.listed_role
        self.groups = [
            main.select(self.main_role, rest, n_heads, self.plan(planner, self.main_role)),
            main.select(role, other, n_heads, self.plan(planner, role)),
        ]

    def fork_into(self, twin: CompressedLayer, planner: GroupPlanner) -> CompressedLayer:
        """Make `twin` (an empty layer of another cache, whose `planner` it gets) share this layer's
        tensors (never modified in place), with only the records that cache asks for; return it."""
        for attr in ("scaling", "query_group", "n_seen", "prompt_len", "is_initialized", "dtype", "device"):
            setattr(twin, attr, getattr(self, attr))
        twin.groups = [
            # a split layer's compressed heads were compressed at the split: not the tokens as seen
            group.fork(
                twin.plan(planner, group.role, with_budget=False),
                group.length == self.n_seen and not (self.is_split() and group is self.main),
            )
            for group in self.groups
        ]
        return twin
