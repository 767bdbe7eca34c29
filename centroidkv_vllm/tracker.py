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
first prefill chunk (computed length 0).

The merging is the harness's own function, `centroidkv.compression.compress_protected`: the sinks and
the recent window kept, `CentroidKV.compress` (Chunked Soft Matching and degree-weighted centroids,
`centroidkv.csm`) on the middle (arXiv 2506.11418, Sec. 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from centroidkv.budget import fit_protected
from centroidkv.centroidkv import CentroidKV
from centroidkv.compression import compress_protected
from centroidkv.kv import LayerKV, LayerStats
from centroidkv_vllm.config import CentroidConfig
from centroidkv_vllm.paged import read_entries, request_slots, write_entries
from centroidkv_vllm.plan import Plan

logger = logging.getLogger("vllm.centroidkv")

NULL_BLOCK = 0  # vLLM's padding block: rows of a dummy run


@dataclass
class RequestState:
    plan: Plan | None = None  # set at the request's first step out of prefill
    compressions: int = 0


class LayerCache:
    """One attention layer's paged cache and its log-degree table ([num_slots, H] float32)."""

    def __init__(self, kv_cache: Tensor, isa: str):
        num_blocks, heads, block_size, _ = kv_cache.shape
        self.kv_cache = kv_cache
        self.isa = isa
        self.log_degree = torch.zeros(num_blocks * block_size, heads, dtype=torch.float32)


def compress_layer(
    layer: LayerCache, slots: Tensor, budget: int, method: CentroidKV, stats: LayerStats
) -> None:
    """Merge the entries at `slots` (a request's kept positions, in order) down to `budget` entries
    with the library's `compress_protected`, written with their log-degrees to the last `budget` of
    those slots (the recent window stays put)."""
    keys, values = read_entries(layer.kv_cache, slots)  # [H, L, D]
    log_degree = layer.log_degree[slots].t()  # [H, L]
    n_sink, n_recent = fit_protected(budget, method.n_sink, method.n_recent, "centroidkv at this budget")
    entries = LayerKV(keys[None], values[None], log_degree[None])
    kept = compress_protected(entries, budget, method, stats, n_sink, n_recent)
    out = slots[slots.numel() - budget :]
    write_entries(layer.kv_cache, out, kept.keys[0], kept.values[0], layer.isa)
    layer.log_degree[out] = kept.log_degree[0].t()


class Tracker:
    """Decides, before each step's attention, which requests to compress, compresses them in every
    layer, and gives each request's kept start (first logical position it holds) for the metadata."""

    def __init__(self, config: CentroidConfig, block_size: int, scale: float):
        self.config = config
        self.block_size = block_size
        self.scale = scale
        self.method = config.method()
        self.states: dict[int, RequestState] = {}  # block holding the request's last entry -> state

    def starts(
        self,
        layers: list[LayerCache],
        seq_lens: Tensor,
        query_lens: Tensor,
        is_prefilling: Tensor | None,
        block_table: Tensor,
    ) -> list[int]:
        """Each request's kept start in this step (after compressing those that are due)."""
        result = []
        for i, (seq_len, query_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
            row = block_table[i]
            last_block = int(row[(seq_len - 1) // self.block_size]) if seq_len > 0 else NULL_BLOCK
            if last_block == NULL_BLOCK or query_len == 0:
                result.append(0)  # a dummy row (padding, profiling run) or a request without tokens
                continue
            computed = seq_len - query_len  # logical entries already in the cache
            prefilling = bool(is_prefilling[i]) if is_prefilling is not None else query_len > 1
            state = self._state(row, computed)
            if state.plan is None and not prefilling:
                config = self.config
                state.plan = Plan.at(computed, config.budget, config.max_new_tokens, config.compress_interval)
            start = 0
            if state.plan is not None:
                start = state.plan.start(computed)
                if state.plan.due(computed):
                    self._compress(layers, state, row, state.plan.start(computed - 1), computed)
            self.states[last_block] = state
            result.append(start)
        return result

    def _state(self, row: Tensor, computed: int) -> RequestState:
        """A new state for a request's first chunk, else the one keyed by the block of its last entry."""
        if computed == 0:
            return RequestState()
        state = self.states.pop(int(row[(computed - 1) // self.block_size]), None)
        if state is None:
            logger.warning("centroidkv: no state for a request at length %d; started afresh", computed)
            return RequestState()
        return state

    def _compress(
        self, layers: list[LayerCache], state: RequestState, row: Tensor, start: int, end: int
    ) -> None:
        """Merge the request's entries at logical positions [start, end) to B in every layer."""
        budget = state.plan.budget
        slots = request_slots(row, start, end, self.block_size)
        for index, layer in enumerate(layers):
            stats = LayerStats(layer_idx=index, n_layers=len(layers), scaling=self.scale)
            compress_layer(layer, slots, budget, self.method, stats)
        state.compressions += 1
        logger.info(
            "centroidkv: request at logical length %d compressed from %d to %d entries in %d layers",
            end,
            end - start,
            budget,
            len(layers),
        )
