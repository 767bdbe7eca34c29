"""SnapKV: keep the tokens the last prompt queries (the observation window) attend to.

Paper: Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen, "SnapKV: LLM Knows What You are
Looking for Before Generation", NeurIPS 2024 (arXiv 2404.14469). The queries of the last
`window_size` prompt tokens attend to the prefix; their attention, averaged over the window and
smoothed by a 1-D pooling of `kernel_size` (so neighbours of an important token survive with it),
scores every prefix token; the top-k are kept together with the window itself.

Here:
- The attention is computed the way the model computes it: post-RoPE window queries against the
  whole layer (sinks and recent window included), scaled by the module's scaling, plus the
  log-degree bias, causal inside the window, softmax in float32.
- GQA: the scores of the query heads sharing a KV head are averaged after pooling (as kvpress and
  SnapKV issue #22 do), so every KV head keeps its own top-k.
- Pooling runs over everything before the recent window (sinks + middle), zero-padded at the edges
  for "avgpool" (`count_include_pad`, as kvpress) and -inf padded for "maxpool"; then the middle's
  scores are used. The window must be inside the protected recent window (`n_recent >=
  window_size`): its tokens are kept as in the paper, and the causal mask inside the window is then
  exact.
- During decoding the cache re-compresses every g tokens with the latest `window_size` queries
  (the paper compresses the prompt only).

Parameters (SnapKV's code, snapkv_utils.py, defaults to kernel 5 + avgpool; the KVCache-Factory
scripts of the PyramidKV authors run window 32, kernel 7, maxpool; kvpress's
SnapKVPress defaults to window 64, kernel 5, avgpool):
  window_size: observation window (default 32, as the KVCache-Factory runs).
  kernel_size: pooling kernel, odd (default 5, as snapkv_utils.py and kvpress).
  pooling: "avgpool" (default, snapkv_utils.py and kvpress) or "maxpool".
  n_sink: protected first tokens (SnapKV has none: 0).
  n_recent: protected recent window, >= window_size (default: 32 = the window).
  compress_interval: g (harness default 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from baselines._select import top_k_in_order
from centroidkv.cache.cache import causal_allowed
from centroidkv.methods import LayerKV, LayerStats, Method, Need, param, register
from centroidkv.needs import query_window

POOLINGS = ("avgpool", "maxpool")


def window_scores(stats: LayerStats, kernel_size: int, pooling: str) -> Tensor:
    """SnapKV scores of the middle segment, [B, H_kv, len(middle)].

    Attention of the stored window queries over the whole layer, averaged over the window, pooled
    over the tokens before the recent window, averaged over the query heads of each KV head.
    """
    if stats.queries is None or stats.keys is None:
        raise ValueError("snapkv scores need the layer's query window and keys (LayerStats.queries/keys)")
    keys, queries = stats.keys, stats.queries
    batch, kv_heads, length, head_dim = keys.shape
    window = queries.shape[2]
    group = queries.shape[1] // kv_heads
    grouped = queries.float().reshape(batch, kv_heads, group * window, head_dim)
    logits = grouped @ keys.float().transpose(-1, -2) * stats.scaling  # [B, H, group*w, T]
    if stats.log_degree is not None:
        logits = logits + stats.log_degree.float().unsqueeze(2)
    allowed = causal_allowed(window, length, keys.device).repeat(group, 1)
    attention = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    prefix = attention[..., : stats.middle.stop].reshape(batch, kv_heads, group, window, -1).mean(dim=3)
    flat = prefix.reshape(batch * kv_heads * group, 1, -1)
    if pooling == "avgpool":
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    scores = pooled.reshape(batch, kv_heads, group, -1).mean(dim=2)
    return scores[..., stats.middle]


@register
@dataclass
class SnapKV(Method):
    name = "snapkv"
    label = "SnapKV"

    n_sink: int = 0
    n_recent: int = 32
    window_size: int = param(
        32,
        minimum=1,
        at_most="n_recent",
        reason="the observation window is among the recent tokens, kept whole",
    )
    kernel_size: int = param(5, minimum=1, parity="odd", reason="same-length pooling")
    pooling: str = param("avgpool", choices=POOLINGS)

    def needs(self) -> tuple[Need, ...]:
        return query_window(self.window_size)

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        scores = window_scores(stats, self.kernel_size, self.pooling)
        return kv.select(top_k_in_order(scores, target_len))
