"""Declared needs: what a method asks the cache to record, and the one recorder that keeps it.

A method declares `needs()`: a tuple of `Need(name, window)`. A cache records the needs of its own
method plus any it is asked to (`CompressedCache(needs=...)`, so that one shared prefill can be
forked to every method of a job). Two kinds of record exist:

- **entry records** ([B, H_kv, T] float32, one value per cached entry, `LayerKV.extras`): they follow
  the entries. The cache appends a value for every new entry (`initial`), may update them after each
  attention call (`after_attention`), slices them with the mergeable middle, `LayerKV.select` gathers
  them, and a merge combines them by the record's `merge` rule: "sum" (a centroid has received the
  attention of all its members) or "mean" (degree-weighted, as keys and values are);
- **window records** (`LayerStats.windows`): the latest `window` rows of something each attention call
  sees, e.g. the query states ([B, H_query, w, D]).

Adding a need is one `Recorder` in `RECORDERS` below and the method's `needs()`; the cache, `fork`,
batch reordering, the prefill and merging handle every record the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Need:
    """`name`: a key of `RECORDERS`; `window`: rows to keep, for window records (0 for entry records)."""

    name: str
    window: int = 0


class Recorder:
    """How one record is kept. Entry records set `merge`; window records set `window = True`."""

    window: bool = False
    merge: str = "sum"  # entry records: "sum" or "mean" (degree-weighted) when entries merge
    uses_received: bool = False  # entry records fed by the attention each entry receives
    rebuildable: bool = False  # entry records that `initial` rebuilds for a cache never compressed

    def initial(self, first_position: int, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        """Entry records: the values of `shape[-1]` new entries whose first position is `first_position`."""
        raise NotImplementedError

    def after_attention(
        self, current: Tensor | None, query: Tensor, received: Tensor | None
    ) -> Tensor | None:
        """The record after an attention call (`received`: [B, H_kv, T] attention per entry)."""
        return current


class AttentionSum(Recorder):
    """Accumulated attention per entry, summed over queries and the query heads of a KV head (H2O, CaM)."""

    merge = "sum"
    uses_received = True

    def initial(self, first_position, shape, device):
        return torch.zeros(shape, dtype=torch.float32, device=device)

    def after_attention(self, current, query, received):
        return current + received


class Position(Recorder):
    """The position of each entry; a centroid's is the degree-weighted mean of its members' positions."""

    merge = "mean"
    rebuildable = True  # an uncompressed cache's entries sit at 0, 1, 2, ...

    def initial(self, first_position, shape, device):
        positions = torch.arange(
            first_position, first_position + shape[-1], dtype=torch.float32, device=device
        )
        return positions.expand(shape).contiguous()


class QueryWindow(Recorder):
    """The latest query states (post-RoPE, [B, H_query, w, D]); the cache trims to the largest window."""

    window = True

    def after_attention(self, current, query, received):
        return query if current is None else torch.cat([current, query], dim=2)


RECORDERS: dict[str, Recorder] = {
    "attention_sum": AttentionSum(),
    "position": Position(),
    "queries": QueryWindow(),
}

ATTENTION_SUM = Need("attention_sum")
POSITION = Need("position")


def query_window(size: int) -> tuple[Need, ...]:
    """The need for the last `size` query states (none when size is 0)."""
    return (Need("queries", size),) if size else ()


def gather_needs(needs: Iterable[Need]) -> dict[str, int]:
    """Union of needs by name -> the largest window asked for (0 for entry records)."""
    merged: dict[str, int] = {}
    for need in needs:
        if need.name not in RECORDERS:
            raise ValueError(f"unknown need {need.name!r}; recorded needs: {', '.join(RECORDERS)}")
        merged[need.name] = max(merged.get(need.name, 0), need.window)
    return merged


def merge_rule(name: str) -> str:
    return RECORDERS[name].merge


def pool_extras(
    extras: dict[str, Tensor], cluster: Tensor, degree: Tensor, n_clusters: int
) -> dict[str, Tensor]:
    """Entry records of clusters: `cluster` [B, H, T] assigns entries to clusters, `degree` [B, H, T]
    their degrees; "sum" records add up, "mean" records take the degree-weighted mean."""
    shape = (*cluster.shape[:2], n_clusters)
    mass = degree.new_zeros(shape).scatter_add_(2, cluster, degree)
    pooled = {}
    for name, record in extras.items():
        weight = degree if merge_rule(name) == "mean" else torch.ones_like(degree)
        total = record.new_zeros(shape, dtype=torch.float32).scatter_add_(2, cluster, record.float() * weight)
        pooled[name] = (total / mass if merge_rule(name) == "mean" else total).to(record.dtype)
    return pooled
