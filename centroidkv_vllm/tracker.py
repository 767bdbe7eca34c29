"""Per-request compression state inside one engine process, and the compression itself.

Layout (`centroidkv_vllm.plan`): a compression at computed length L writes the request's B kept
entries into the slots of its logical positions [L - B, L); new tokens keep their own logical slots,
so vLLM's `slot_mapping` is used as it is. A request holds the logical positions [start, length), and
the scheduler (`centroidkv_vllm.scheduler`) frees the blocks wholly before `start`: the worker's block
table keeps their stale ids, which are never read again.

A running request is known by the block that holds its last entry (after a step: the block of
position length - 1), looked up at its next step and re-keyed: a running request's blocks from its
start on are its own (prefix caching, which would share them, is refused in `centroidkv_vllm.config`),
while its first block may have been freed and given to another request. Its state is reset by its
first prefill chunk (computed length 0). A finished or preempted request's state goes at the next
step when the release connector is configured (`centroidkv_vllm.connector`: `forget_released`), else
once another request of a step holds one of its blocks (`Tracker._drop_finished`).

The tracker only decides: each step it gives every request's kept start and the compressions due
(`Compression`), which the metadata builder hands to the attention as a `CompressionStep`. Each
layer's attention runs that step on its own cache (`CompressionStep.run`) before it writes the step's
entries. The merging is the harness's own function, `centroidkv.compression.compress_protected`: the
sinks and the recent window kept, `CentroidKV.compress` (Chunked Soft Matching and degree-weighted
centroids, `centroidkv.csm`) on the middle (arXiv 2506.11418, Sec. 3).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from centroidkv.cache.budget import fit_protected
from centroidkv.centroidkv import CentroidKV
from centroidkv.compression import compress_protected
from centroidkv.kv import LayerKV, LayerStats
from centroidkv_vllm.config import CentroidConfig
from centroidkv_vllm.heads import HeadLayout, SideStore
from centroidkv_vllm.paged import read_entries, request_slots, write_entries
from centroidkv_vllm.plan import Plan

logger = logging.getLogger("vllm.centroidkv")

NULL_BLOCK = 0  # vLLM's padding block: rows of a dummy run


@dataclass
class RequestState:
    plan: Plan | None = None  # set at the request's first step out of prefill
    compressions: int = 0
    store: SideStore | None = None  # heads kept whole: made at the first compression (centroidkv_vllm.heads)


class LayerCache:
    """One attention layer's paged cache and its log-degree table ([num_slots, H] float32), held by the
    layer's attention (`centroidkv_vllm.backend.CentroidImpl`)."""

    def __init__(self, kv_cache: Tensor, isa: str):
        num_blocks, heads, block_size, _ = kv_cache.shape
        self.kv_cache = kv_cache
        self.isa = isa
        self.log_degree = torch.zeros(num_blocks * block_size, heads, dtype=torch.float32)


def compress_layer(
    layer: LayerCache,
    slots: Tensor,
    budget: int,
    method: CentroidKV,
    stats: LayerStats,
    listed: tuple[int, ...] = (),
    store: SideStore | None = None,
) -> None:
    """Merge the entries at `slots` (a request's kept positions, in order) down to `budget` entries
    with the library's `compress_protected`, written with their log-degrees to the last `budget` of
    those slots (the recent window stays put).

    `listed`: the layer's KV heads kept whole, which are not merged: at the request's first
    compression (`slots` then holds every position from 0) their entries go to its side store
    `store`, and their slots in the pool get zeros (never read again: the attention reads them from
    the store)."""
    keys, values = read_entries(layer.kv_cache, slots)  # [H, L, D]
    log_degree = layer.log_degree[slots].t()  # [H, L]
    rest = [head for head in range(keys.shape[0]) if head not in listed]
    if listed and not store.has(stats.layer_idx):
        store.start(stats.layer_idx, keys[list(listed)], values[list(listed)])
    n_sink, n_recent = fit_protected(budget, method.n_sink, method.n_recent, "centroidkv at this budget")
    entries = LayerKV(keys[None, rest], values[None, rest], log_degree[None, rest])
    kept = compress_protected(entries, budget, method, stats, n_sink, n_recent)
    out = slots[slots.numel() - budget :]
    if listed:  # every head is written back: the listed ones as zeros
        kept_keys, kept_values = (
            keys.new_zeros(keys.shape[0], budget, keys.shape[2]),
            keys.new_zeros(keys.shape[0], budget, keys.shape[2]),
        )
        kept_degree = log_degree.new_zeros(keys.shape[0], budget)
        kept_keys[rest], kept_values[rest], kept_degree[rest] = (
            kept.keys[0],
            kept.values[0],
            kept.log_degree[0],
        )
    else:
        kept_keys, kept_values, kept_degree = kept.keys[0], kept.values[0], kept.log_degree[0]
    write_entries(layer.kv_cache, out, kept_keys, kept_values, layer.isa)
    layer.log_degree[out] = kept_degree.t()


@dataclass(frozen=True)
class Compression:
    """A request merged in this step: its entries at `slots` (its logical positions [start, length), in
    order) down to `budget` entries."""

    slots: Tensor
    budget: int
    length: int  # the request's logical (computed) length
    store: SideStore | None = None  # the request's side store (heads kept whole)


@dataclass(frozen=True)
class CompressionStep:
    """This step's compressions in one KV cache group, the same for each of its layers: every layer runs
    them on its own cache (`run`) before the step's new entries are written, so a block freed in this
    step and given to another request is read before that request overwrites it."""

    compressions: tuple[Compression, ...]
    method: CentroidKV
    layer_names: tuple[str, ...]  # the group's layers in order (a layer's index for `LayerStats`)
    scale: float
    listed: tuple[tuple[int, ...], ...] = ()  # per layer index, the KV heads kept whole (`HeadLayout`)

    def run(self, layer_name: str, layer: LayerCache) -> None:
        """Merge each due request in this layer's cache and log-degrees (`compress_layer`)."""
        if not self.compressions:
            return
        index = self.layer_names.index(layer_name)
        stats = LayerStats(layer_idx=index, n_layers=len(self.layer_names), scaling=self.scale)
        listed = self.listed[index] if self.listed else ()
        for item in self.compressions:
            compress_layer(layer, item.slots, item.budget, self.method, stats, listed, item.store)
        if index == len(self.layer_names) - 1:  # the group's last layer: every layer has merged
            for item in self.compressions:
                logger.info(
                    "centroidkv: request at logical length %d compressed from %d to %d entries in %d layers",
                    item.length,
                    item.slots.numel(),
                    item.budget,
                    len(self.layer_names),
                )


class Tracker:
    """Decides, before each step, which requests are compressed in it, and gives each request's kept
    start (first logical position it holds) for the metadata; the compressions themselves run in each
    layer's attention (`CompressionStep`)."""

    def __init__(
        self, config: CentroidConfig, block_size: int, scale: float, layout: HeadLayout | None = None
    ):
        self.config = config
        self.block_size = block_size
        self.scale = scale
        self.layout = layout
        self.method = config.method()
        self.states: dict[int, RequestState] = {}  # block holding the request's last entry -> state
        self.stores: list[SideStore | None] = []  # this step's side store of each request (or None)
        TRACKERS.add(self)

    def plan_at(self, anchor: int) -> Plan:
        """The plan of a request anchored at `anchor` (`centroidkv_vllm.plan`, B in bytes with heads
        kept whole: `HeadLayout.budget_at`)."""
        config = self.config
        budget_at = None if self.layout is None else self.layout.budget_at(config, anchor)
        return Plan.at(anchor, config.budget, config.max_new_tokens, config.compress_interval, budget_at)

    def step(
        self,
        seq_lens: Tensor,
        query_lens: Tensor,
        is_prefilling: Tensor | None,
        block_table: Tensor,
    ) -> tuple[list[int], tuple[Compression, ...]]:
        """Each request's kept start in this step, and the compressions due before its attention."""
        starts, due, stores, held, assigned = [], [], [], set(), set()
        for i, (seq_len, query_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
            row = block_table[i]
            last_block = int(row[(seq_len - 1) // self.block_size]) if seq_len > 0 else NULL_BLOCK
            if last_block == NULL_BLOCK or query_len == 0:
                starts.append(0)  # a dummy row (padding, profiling run) or a request without tokens
                stores.append(None)
                continue
            computed = seq_len - query_len  # logical entries already in the cache
            prefilling = bool(is_prefilling[i]) if is_prefilling is not None else query_len > 1
            state = self._state(row, computed)
            if state.plan is None and not prefilling:
                state.plan = self.plan_at(computed)
            start = 0
            if state.plan is not None:
                start = state.plan.start(computed)
                if state.plan.due(computed):
                    if self.layout is not None and state.store is None:
                        state.store = SideStore(headroom=max(1, self.config.max_new_tokens))
                    slots = request_slots(row, state.plan.start(computed - 1), computed, self.block_size)
                    budget = state.plan.entries_at(computed)
                    due.append(Compression(slots, budget, computed, state.store))
                    state.compressions += 1
            self.states[last_block] = state
            assigned.add(last_block)
            starts.append(start)
            stores.append(state.store)
            held.update(row[start // self.block_size : (seq_len - 1) // self.block_size + 1].tolist())
        self._drop_finished(held, assigned)
        self.stores = stores
        return starts, tuple(due)

    def _drop_finished(self, held: set[int], assigned: set[int]) -> None:
        """Drop the states of requests that have finished (or were preempted): a state keyed by a
        block that a request of this step holds, other than by its own last block. A running request
        that is not scheduled in this step keeps its blocks, so its key lies in no other request's
        range; a finished request's blocks went back to the pool, and its state (with its side store)
        goes once one of them holds another request's entries."""
        self.forget(held - assigned)

    def forget(self, block_ids: set[int]) -> int:
        """Drop the states keyed by blocks the scheduler has given back (`centroidkv_vllm.connector`);
        the number dropped."""
        keys = [block for block in self.states if block in block_ids]
        for block in keys:
            del self.states[block]
        return len(keys)

    def _state(self, row: Tensor, computed: int) -> RequestState:
        """A new state for a request's first chunk, else the one keyed by the block of its last entry."""
        if computed == 0:
            return RequestState()
        state = self.states.pop(int(row[(computed - 1) // self.block_size]), None)
        if state is None:
            logger.warning("centroidkv: no state for a request at length %d; started afresh", computed)
            return RequestState()
        return state


# This process's trackers (one per KV cache group's metadata builder): the release connector reaches
# them here, as vLLM builds the connector and the attention's builders apart.
TRACKERS: weakref.WeakSet[Tracker] = weakref.WeakSet()


def forget_released(block_ids: Iterable[int]) -> None:
    """Every tracker of this process drops the states keyed by `block_ids` (given back by the scheduler:
    their requests finished or were preempted)."""
    block_ids = set(block_ids)
    dropped = sum(tracker.forget(block_ids) for tracker in list(TRACKERS))
    if dropped:
        logger.debug("centroidkv: dropped the states of %d finished or preempted requests", dropped)


def held_side_stores() -> int:
    """The side stores this process's trackers hold (an engine in this process)."""
    return sum(state.store is not None for tracker in list(TRACKERS) for state in tracker.states.values())
