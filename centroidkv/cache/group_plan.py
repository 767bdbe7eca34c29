"""What one head group does with its heads, as a value its layer hands it (`GroupPlan`).

A head group (`centroidkv.cache.head_group`) stores tensors; what it should do with them (the budget it is
compressed to and when, the storage format, which records to keep, how much headroom its buffers
get) depends on settings of its cache, its layer and its method, which change: the prompt arrives,
a byte plan is solved again, compression is paused. Rather than reach up to its layer and cache for
them, a group is handed a frozen `GroupPlan` on every call that needs one: values go down, so a
group holds no reference to its layer or cache (no reference cycle to free, nothing it could read
out of date), and it can be driven, or tested, with any plan.

The cache's planner builds the plans (`centroidkv.cache.planner.GroupPlanner.group_plan`) and the layer
hands them down (`centroidkv.cache.cache_layer`): the planner is the only place where a group's role
("compressed", "whole", "favoured", "window") is turned into settings, and where a method's fields
are read for a group. Nothing here reads the method's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from centroidkv.cache.budget import fit_protected
from centroidkv.cache.quantization import StorageFormat

if TYPE_CHECKING:
    from centroidkv.methods import Method


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One head group's settings for the call it is handed to (module docstring)."""

    # --- what it stores ---
    storage: StorageFormat  # keys' and values' format (a window layer's: the model's dtype)
    in_place: bool  # decode into buffers with headroom; False concatenates every step
    keeps_records: bool  # log-degrees and records (False: heads never compressed keep none)
    entry_records: tuple[str, ...]  # per-entry records to keep (`centroidkv.needs`)
    window_records: tuple[tuple[str, int], ...]  # (name, rows) of the window records to keep
    # --- its budget ---
    budget_len: int | None  # entries it is compressed to (None: never, or no prompt yet)
    compress_above: int | None  # compress once it holds more entries (None: not now)
    compresses: bool  # the method compresses these heads: a compression leaves room for g tokens
    compress_interval: int  # g: tokens decoded between two compressions
    max_new_tokens: int  # the generation the cache was planned for (first buffers' headroom)
    window: int | None  # a window layer's W: its buffers hold the W - 1 kept entries and one more
    # --- how it compresses ---
    method: Method  # what compresses the middle (`centroidkv.compression.compress_protected`)
    n_sink: int  # the method's protected first tokens
    n_recent: int  # the method's protected last tokens
    merges: bool  # a compression writes log-degrees (the method merges entries)
    label: str  # the method's name, for messages

    def protected_windows(self) -> tuple[int, int]:
        """(n_sink, n_recent) a compression keeps: the method's, shrunk to the budget when it cannot
        hold them (`centroidkv.cache.budget.fit_protected`: the recent window first, then the sinks)."""
        return fit_protected(self.budget_len, self.n_sink, self.n_recent, f"{self.label} at this budget")
