"""CentroidKV: merge similar tokens of the KV cache into degree-weighted centroids.

Paper: Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering", arXiv 2506.11418
(v1 named the method Chelsea). The cache is clustered by Chunked Soft Matching (`centroidkv.csm`)
after prefill and whenever decoding has added `compress_interval` tokens beyond the budget;
attention then adds log(degree) to the logits (`centroidkv.attention`).

Parameters (defaults: the paper's where it gives them, ours otherwise; see PAPER.md):
  chunk_size: c, tokens per chunk; matching stays inside a chunk (paper: 256; even, >= 2).
  r_init: merge fraction of A tokens in the first round of a compression (ours: 0.5, swept: README).
  delta_r: linear annealing step of r per round (ours: 0, i.e. constant; the sweep found aggressive
    first rounds annealed down, as in the paper's v1, lose needles: README "Choosing the schedule").
  r_min: floor of r, > 0 so the budget is always reached (ours: 0.1).
  n_sink, n_recent: protected first / last tokens (paper: 16 / 64).
  compress_interval: g, re-compression interval during decoding (ours: 64).
"""

from __future__ import annotations

from dataclasses import dataclass

from centroidkv.csm import csm_compress
from centroidkv.methods import LayerKV, LayerStats, Method, check_float, register
from centroidkv.schedule import LinearSchedule


@register
@dataclass
class CentroidKV(Method):
    name = "centroidkv"
    label = "CentroidKV"
    merges = True

    chunk_size: int = 256
    r_init: float = 0.5
    delta_r: float = 0.0
    r_min: float = 0.1

    def validate(self) -> None:
        super().validate()
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 2:
            raise ValueError(f"centroidkv: chunk_size must be an even integer >= 2, got {self.chunk_size!r}")
        if self.chunk_size % 2:
            raise ValueError(f"centroidkv: chunk_size must be even (A/B alternate), got {self.chunk_size}")
        check_float(self, "r_init", 0.0, 1.0, low_open=True)
        check_float(self, "delta_r", 0.0, 1.0)
        check_float(self, "r_min", 0.0, 1.0, low_open=True)
        if self.r_min > self.r_init:
            raise ValueError(f"centroidkv: r_min ({self.r_min}) must not exceed r_init ({self.r_init})")

    @property
    def schedule(self) -> LinearSchedule:
        return LinearSchedule(self.r_init, self.delta_r, self.r_min)

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        return csm_compress(kv, target_len, self.chunk_size, self.schedule)
