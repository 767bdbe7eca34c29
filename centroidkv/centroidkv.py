"""CentroidKV: merge similar tokens of the KV cache into degree-weighted centroids.

Paper: Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering", arXiv 2506.11418
(v1 named the method Chelsea). The cache is clustered by Chunked Soft Matching (`centroidkv.csm`)
after prefill and whenever decoding has added `compress_interval` tokens beyond the budget;
attention then adds log(degree) to the logits (`centroidkv.attention`). Our decisions where the paper
is silent, with the evidence: docs/method.md (decisions) and docs/results.md (measurements).

Parameters (defaults: the paper's where it gives them, ours otherwise; ours are the best configuration
of the ablation on the embedded model, `make ablate-centroidkv`, docs/results.md "Choosing the defaults"):
  chunk_size: c, tokens per chunk; matching stays inside a chunk (paper: 256; even, >= 2).
  schedule: "linear" (the paper's r_j = r_init - j * delta_r, clamped to [r_min, 1]) or "adaptive"
    (each round merges the edges at or above the round's mean similarity; `centroidkv.schedule`).
  r_init: merge fraction of A tokens in the first round of a compression (linear schedule).
  delta_r: linear annealing step of r per round (0: constant).
  r_min: floor of the per-round merge fraction, > 0 so the budget is always reached (both schedules).
  similarity: "post_rope" (the cached keys) or "pre_rope" (keys with the model's rotary embedding
    undone at each entry's degree-weighted mean position, recorded as the "position" need and counted
    in kv_bytes). Merging always averages the cached (post-RoPE) keys and the values.
  heads, heads_file, heads_fraction, heads_boost: the head policy every method takes
    (`centroidkv.head_policy`, a wrapper: `wrapper_params` sets its defaults here). CentroidKV's default is the paper's: heads="whole" with the "clustering"
    score, the 4 % of (layer, KV head) pairs that clustering damages most keep every token (the
    calibrated list of the model the cache runs on: the user cache dir, else the list shipped in the
    package; a model with neither is refused with one line naming `python -m eval.calibrate`, which
    the harness's runner runs itself when the model loads). In bytes the whole heads are paid for by
    the compressed ones.
  n_sink, n_recent: protected first / last tokens (paper: 16 / 64).
  compress_interval: g, re-compression interval during decoding (ours: 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from centroidkv.csm import csm_compress
from centroidkv.methods import LayerKV, LayerStats, Method, Need, param, register
from centroidkv.needs import POSITION
from centroidkv.schedule import AdaptiveSchedule, LinearSchedule

SIMILARITIES = ("post_rope", "pre_rope")
SCHEDULES = ("linear", "adaptive")
ROPE_SLICE = 512  # tokens per slice when undoing RoPE on a CPU


def undo_rope(keys: Tensor, positions: Tensor, rotary, unit: bool = False) -> Tensor:
    """Keys [B, H, T, D] rotated back by their (possibly fractional) positions [B, H, T], float32;
    with `unit`, also scaled to unit length (the matching keys of pre-RoPE similarity).

    Uses the model's own rotary embedding module's frequencies (`rotary.inv_freq`, in which scaled
    variants such as Llama-3's are already applied) and transformers' Llama/Mistral/Qwen2 layout, where
    dimension i pairs with i + D/2. The module's attention scaling of cos/sin only rescales keys, which
    cosine similarity ignores. Inverse of (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    positions = positions.float()
    if positions.shape[1] > 1 and torch.equal(positions, positions[:, :1].expand_as(positions)):
        positions = positions[:, :1]  # no merge yet: every head has the same positions, one cos/sin
    inv_freq = rotary.inv_freq.float()
    unrotated = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    # On a CPU, in slices of tokens that stay in the cache through the steps below (elementwise and
    # per-row work: the bits are those of one pass over all tokens).
    length = keys.shape[2]
    slice_len = ROPE_SLICE if keys.device.type == "cpu" else max(1, length)  # an empty segment: no slice
    for start in range(0, length, slice_len):
        part = slice(start, start + slice_len)
        angle = positions[:, :, part].unsqueeze(-1) * inv_freq  # [B, H or 1, t, D/2]
        cos, sin = angle.cos(), angle.sin()
        rotated_1, rotated_2 = keys[:, :, part].float().chunk(2, dim=-1)
        out = unrotated[:, :, part]
        first, second = out.chunk(2, dim=-1)
        torch.mul(rotated_1, cos, out=first).addcmul_(rotated_2, sin)
        torch.mul(rotated_2, cos, out=second).addcmul_(rotated_1, sin, value=-1)
        if unit:  # in the same buffer: what F.normalize(unrotated) gives, bit for bit, without a copy
            out.div_(torch.linalg.vector_norm(out, dim=-1, keepdim=True).clamp_(min=1e-12))
    return unrotated


@register
@dataclass
class CentroidKV(Method):
    name = "centroidkv"
    label = "CentroidKV"
    merges = True

    chunk_size: int = param(256, minimum=2, parity="even", reason="A/B alternate")
    schedule: str = param("adaptive", choices=SCHEDULES)
    r_init: float = param(0.5, minimum=0.0, maximum=1.0, low_open=True)
    delta_r: float = param(0.0, minimum=0.0, maximum=1.0)
    r_min: float = param(0.1, minimum=0.0, maximum=1.0, low_open=True, at_most="r_init")
    similarity: str = param("pre_rope", choices=SIMILARITIES)
    # the paper's outlier heads kept whole (`centroidkv.head_policy`), listed by the clustering score,
    # whose head file records the clustering it measured: other settings are warned about
    wrapper_params = {"heads": "whole", "heads_file": "clustering"}
    compares_calibration = True

    @property
    def rows_independent(self) -> bool:
        return self.schedule != "adaptive"  # its merge count averages over the batch's rows

    def needs(self) -> tuple[Need, ...]:
        return (POSITION,) if self.similarity == "pre_rope" else ()

    @property
    def merge_schedule(self) -> LinearSchedule | AdaptiveSchedule:
        if self.schedule == "adaptive":
            return AdaptiveSchedule(self.r_min)
        return LinearSchedule(self.r_init, self.delta_r, self.r_min)

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        unit_match_keys = None
        if self.similarity == "pre_rope":
            if stats.rotary is None or "position" not in kv.extras:
                raise ValueError(
                    "centroidkv: pre_rope similarity needs the model's rotary embedding and recorded "
                    "positions (a cache on a model prepared by centroidkv)"
                )

            def unit_match_keys(keys: Tensor, records: dict[str, Tensor]) -> Tensor:
                return undo_rope(keys, records["position"], stats.rotary, unit=True)

        return csm_compress(
            kv, target_len, self.chunk_size, self.merge_schedule, unit_match_keys=unit_match_keys
        )
