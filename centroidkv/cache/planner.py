"""What a cache decides for its head groups, handed down to its layers as a value (`GroupPlanner`).

A cache (`centroidkv.cache.cache.CompressedCache`) holds the settings every plan depends on (its method,
budget and budget unit, storage format, records, the model it serves, whether compression is
paused); a layer (`centroidkv.cache.cache_layer`) knows its own state (tokens seen, the prompt's length, its
shape). On every call of a layer that needs plans, the cache hands the layer a `GroupPlanner`: the
cache's settings as they are now. The layer asks it for each group's `GroupPlan`
(`centroidkv.cache.group_plan`), passing its own state as a value (`LayerState`). So values only go
down: a planner refers to no layer and no cache, and a layer refers to no planner between calls.

This is the one place a group's role ("compressed", "whole", "favoured", "window") is turned into
settings, and where a method's fields are read for a group. Two answers are worked out once and kept
in the cache's `PlanMemo`, which every planner of that cache shares: the heads the head policy lists
(they need the model), and in bytes each layer's B (`centroidkv.cache.byte_plan.solve`), solved again only
when a compression sees another prompt or, with listed heads that grow, more tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from centroidkv.cache.budget import budget_entries
from centroidkv.cache.byte_plan import ByteShape, solve
from centroidkv.cache.group_plan import GroupPlan
from centroidkv.cache.quantization import StorageFormat
from centroidkv.head_policy import HeadPolicy, favoured_len
from centroidkv.kv import LayerStats
from centroidkv.methods import Method

# A head group's role: which plan its planner builds for it (`GroupPlanner.group_plan`).
ROLES = ("compressed", "whole", "favoured", "window")


@dataclass(frozen=True, slots=True)
class LayerState:
    """What a layer tells its planner about itself (`CompressedLayer.state`)."""

    index: int
    prompt_len: int | None  # None before the prompt
    n_seen: int  # tokens seen
    window: int | None  # a window layer's W (`centroidkv.cache.window_layer`)
    query_group: int  # query heads per KV head (as its first attention call found)
    # its shape, once it holds tokens (what a byte plan is solved for); 0 before
    batch: int = 0
    n_heads: int = 0  # every KV head of the layer, over its groups
    head_dim: int = 0
    itemsize: int = 0  # bytes of one element in the model's dtype


@dataclass(slots=True)
class PlanMemo:
    """What a cache's planners work out once and share (module docstring)."""

    listed: dict[int, list[int]] | None = None  # KV heads listed per layer
    byte_key: tuple[int, int] | None = None  # (prompt length, tokens seen) the byte plan was solved for
    byte_lengths: list[int] | None = None  # B per layer, in bytes


@dataclass(frozen=True, slots=True)
class GroupPlanner:
    """A cache's settings at one call of a layer, which turn a group's role into its plan."""

    method: Method
    budget: float  # R
    budget_unit: str  # "bytes" or "entries" (`centroidkv.cache.budget`)
    max_new_tokens: int  # Gamma
    in_place: bool
    storage: StorageFormat
    head_policy: HeadPolicy
    entry_needs: tuple[str, ...]  # per-entry records the cache keeps
    window_needs: tuple[tuple[str, int], ...]  # (name, rows) of the window records it keeps
    compression_enabled: bool  # False while the cache is paused
    n_layers: int | None  # the model's, None before the cache met a prepared model
    rotary: list | None  # each layer's rotary table, or None
    sliding_windows: dict[int, int]  # {layer: W} of a hybrid model
    query_group: int | None  # the model's query heads per KV head
    model_ref: Callable[[], nn.Module | None]  # weak reference to the model
    memo: PlanMemo

    # --- the listed heads (centroidkv.head_policy) ------------------------------------------------
    def heads_listed(self) -> dict[int, list[int]]:
        """The KV heads per layer that the method's head policy lists, asked once (needs the model:
        `prepare_model`); a window layer's heads are never listed (it is never compressed)."""
        if self.memo.listed is None:
            listed = self.head_policy.listed_heads(self.model_ref())
            self.memo.listed = {
                layer: heads for layer, heads in listed.items() if layer not in self.sliding_windows
            }
        return self.memo.listed

    @property
    def listed_role(self) -> str:
        """The role of the heads the head policy lists: "whole" (heads=whole) or "favoured" (budget)."""
        return "whole" if self.head_policy.listed_whole else "favoured"

    def stats(self, layer_idx: int, scaling: float) -> LayerStats:
        """What a method may read besides a group's entries: the layer, its scaling, its rotary table
        (the windows are each group's own: `HeadGroup.compress` adds them)."""
        rotary = self.rotary[layer_idx] if self.rotary else None
        return LayerStats(layer_idx, self.n_layers, scaling, rotary=rotary)

    # --- the plans (centroidkv.cache.group_plan) -------------------------------------------------------
    def group_plan(self, layer: LayerState, role: str, with_budget: bool = True) -> GroupPlan:
        """What a group of `role` in `layer` does now. `with_budget=False` leaves the budget out (a
        fork's layer, whose cache has not all its layers yet)."""
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
            window_records=self.window_needs if keeps_records else (),
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

    def role_budget(self, layer: LayerState, role: str) -> int | None:
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

    # --- the budget (centroidkv.cache.cache's docstring; centroidkv.cache.budget) ---------------------
    def layer_budget_len(self, layer: LayerState) -> int:
        """B for `layer`: entries per compressed head, in the cache's budget unit."""
        if self.budget_unit == "entries" or not self.method.compresses:
            entries = budget_entries(self.budget, layer.prompt_len, self.max_new_tokens)
            return self.method.layer_budget(entries, layer.index, self.n_layers)
        if self.memo.byte_lengths is None:
            self.solve_budget(layer)
        return self.memo.byte_lengths[layer.index]

    def solve_budget(self, layer: LayerState) -> None:
        """In bytes, solve every layer's B for what is stored when `layer` compresses. Listed heads
        (kept whole, or favoured below their own budget) grow while decoding, so the plan is solved
        again at a compression that sees more tokens; between compressions it holds (the cache then
        grows to B + g, as with entries)."""
        if self.budget_unit != "bytes" or not self.method.compresses:
            return
        key = (layer.prompt_len, layer.n_seen if self.heads_listed() else 0)
        if self.memo.byte_lengths is None or self.memo.byte_key != key:
            self.memo.byte_key, self.memo.byte_lengths = key, solve(self.byte_shape(layer))

    def byte_shape(self, layer: LayerState) -> ByteShape:
        """What the byte plan depends on when `layer` compresses (`centroidkv.cache.byte_plan.ByteShape`)."""
        method, listed, n_layers = self.method, self.heads_listed(), self.n_layers
        return ByteShape(
            batch=layer.batch,
            n_heads=layer.n_heads,
            head_dim=layer.head_dim,
            itemsize=layer.itemsize,
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
            window_records=sum(rows for _, rows in self.window_needs),
            layer_budget=method.layer_budget,
            method_name=method.name,
        )
