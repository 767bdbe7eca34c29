"""Per-request compression state inside one engine process, and the compression itself.

A running request is known by the first block of its block table (vLLM gives a running request's
blocks to no one else; prefix caching, which would share them, is refused in `centroidkv_vllm.config`).
Its state is reset by its first prefill chunk. Entries stay at the front of the request's blocks:
after m entries have been merged away, the token at logical position p is stored at physical position
p - m, while vLLM keeps p for RoPE. vLLM still counts the request by its logical length, so no block
returns to the pool yet (docs/vllm.md).

The merging is the harness's: `CentroidKV.compress` (Chunked Soft Matching and degree-weighted
centroids, `centroidkv.csm`) on the unprotected middle, with the sinks and the recent window spliced
around it as `centroidkv.cache.CompressedLayer.compress` does (arXiv 2506.11418, Sec. 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from centroidkv.budget import budget_entries, fit_protected
from centroidkv.centroidkv import CentroidKV
from centroidkv.kv import LayerKV, LayerStats
from centroidkv_vllm.config import CentroidConfig
from centroidkv_vllm.paged import read_entries, request_slots, write_entries

logger = logging.getLogger("vllm.centroidkv")

NULL_BLOCK = 0  # vLLM's padding block: rows of a dummy run


@dataclass
class RequestState:
    removed: int = 0  # entries merged away so far: logical length - physical length
    prompt_len: int | None = None  # known at the first decode step
    budget: int | None = None  # B = R * (n + Gamma)
    compressions: int = 0


class LayerCache:
    """One attention layer's paged cache and its log-degree table ([num_slots, H] float32)."""

    def __init__(self, kv_cache: Tensor, isa: str):
        num_blocks, heads, block_size, _ = kv_cache.shape
        self.kv_cache = kv_cache
        self.isa = isa
        self.log_degree = torch.zeros(num_blocks * block_size, heads, dtype=torch.float32)


def make_method(config: CentroidConfig) -> CentroidKV:
    """The harness's CentroidKV with the plugin's settings: every head compressed (heads=none) and
    similarity on the cached (post-RoPE) keys."""
    return CentroidKV(
        chunk_size=config.chunk_size,
        schedule=config.schedule,
        r_min=config.r_min,
        similarity="post_rope",
        heads="none",
        n_sink=config.n_sink,
        n_recent=config.n_recent,
        compress_interval=config.compress_interval,
    )


def compress_layer(
    layer: LayerCache, slots: Tensor, budget: int, method: CentroidKV, stats: LayerStats
) -> None:
    """Merge the entries at `slots` (a request's physical positions, in order) down to `budget`
    entries, written back to the first `budget` slots with their log-degrees."""
    length = slots.numel()
    keys, values = read_entries(layer.kv_cache, slots)
    log_degree = layer.log_degree[slots].t()  # [H, L]
    n_sink, n_recent = fit_protected(budget, method.n_sink, method.n_recent, "centroidkv at this budget")
    middle = slice(n_sink, length - n_recent)
    segment = LayerKV(keys[None, :, middle], values[None, :, middle], log_degree[None, :, middle])
    kept = method.compress(segment, budget - n_sink - n_recent, stats)

    def splice(full: Tensor, new_middle: Tensor) -> Tensor:
        return torch.cat([full[:, :n_sink], new_middle.to(full.dtype), full[:, length - n_recent :]], dim=1)

    out = slots[:budget]
    write_entries(layer.kv_cache, out, splice(keys, kept.keys[0]), splice(values, kept.values[0]), layer.isa)
    layer.log_degree[out] = splice(log_degree, kept.log_degree[0]).t()


class Tracker:
    """Decides, before each step's attention, which requests to compress, compresses them in every
    layer, and gives each request's offset (entries removed) for the step's metadata."""

    def __init__(self, config: CentroidConfig, block_size: int, scale: float):
        self.config = config
        self.block_size = block_size
        self.scale = scale
        self.method = make_method(config)
        self.states: dict[int, RequestState] = {}

    def offsets(
        self,
        layers: list[LayerCache],
        seq_lens: Tensor,
        query_lens: Tensor,
        is_prefilling: Tensor | None,
        block_table: Tensor,
    ) -> list[int]:
        """Entries removed per request of this step (after compressing those that are due)."""
        result = []
        for i, (seq_len, query_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
            first_block = int(block_table[i, 0])
            if first_block == NULL_BLOCK or query_len == 0:
                result.append(0)
                continue
            computed = seq_len - query_len  # logical entries already in the cache
            if computed == 0:
                self.states[first_block] = RequestState()
            state = self.states.setdefault(first_block, RequestState())
            prefilling = bool(is_prefilling[i]) if is_prefilling is not None else query_len > 1
            if not prefilling:
                self._maybe_compress(layers, state, computed, block_table[i])
            result.append(state.removed)
        return result

    def _maybe_compress(
        self, layers: list[LayerCache], state: RequestState, computed: int, block_row: Tensor
    ) -> None:
        """Compress after the prompt (n > B) and whenever the request has grown to B + g."""
        if state.budget is None:
            state.prompt_len = computed
            state.budget = budget_entries(self.config.budget, computed, self.config.max_new_tokens)
        physical = computed - state.removed
        limit = (
            state.budget if computed == state.prompt_len else state.budget + self.config.compress_interval - 1
        )
        if physical <= limit or state.budget < 1:
            return
        slots = request_slots(block_row, physical, self.block_size)
        for index, layer in enumerate(layers):
            stats = LayerStats(layer_idx=index, n_layers=len(layers), scaling=self.scale)
            compress_layer(layer, slots, state.budget, self.method, stats)
        state.removed += physical - state.budget
        state.compressions += 1
        logger.info(
            "centroidkv: request at logical length %d compressed from %d to %d entries in %d layers",
            computed,
            physical,
            state.budget,
            len(layers),
        )
