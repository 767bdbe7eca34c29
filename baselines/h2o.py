"""H2O: keep the heavy hitters (tokens with the most accumulated attention) and the recent tokens.

Paper: Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang, Chen, "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023
(arXiv 2306.14048). Each cached token's score is the attention it has received, summed over all
queries so far (prefill and decoding); the cache keeps the highest-scoring tokens plus a window of
the most recent ones, the paper's default splitting the budget half/half.

Here the score is `LayerKV.attention_sum`, which the cache accumulates for this method during the
prefill and every decoding step (summed over the query heads that share a KV head; with GQA this is
the natural per-KV-head version of the per-head score). The budget split follows the paper: a
fraction `recent_ratio` of the layer budget B is a recent window. The cache already protects the
last `n_recent` tokens, so the method keeps the `round(recent_ratio * B) - n_recent` newest middle
tokens (when positive) and fills the rest of the middle by score. Ties go to the earlier token.

Parameters:
  recent_ratio: fraction of the budget that is a recent window (paper: 0.5, i.e. heavy = recent).
  n_sink: protected first tokens (H2O has none: 0).
  n_recent: protected recent window (harness default 64; part of the recent_ratio share).
  compress_interval: g, decoding re-compresses every g tokens beyond the budget (harness default 64;
    the paper evicts one token per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from baselines._select import top_k_in_order
from centroidkv.methods import LayerKV, LayerStats, Method, Need, param, register
from centroidkv.needs import ATTENTION_SUM


@register
@dataclass
class H2O(Method):
    name = "h2o"
    label = "H2O"

    n_sink: int = 0
    recent_ratio: float = param(
        0.5, minimum=0.0, maximum=1.0, high_open=True, reason="1 leaves no room for heavy hitters"
    )

    def needs(self) -> tuple[Need, ...]:
        return (ATTENTION_SUM,)

    def n_recent_middle(self, target_len: int) -> int:
        """Newest middle tokens kept unconditionally, so that the recent share is recent_ratio * B."""
        budget = target_len + self.n_sink + self.n_recent
        return min(target_len, max(0, round(self.recent_ratio * budget) - self.n_recent))

    def kept_index(self, kv: LayerKV, target_len: int) -> Tensor:
        """[B, H, target_len] positions of the middle that survive, in sequence order."""
        if kv.attention_sum is None:
            raise ValueError(f"{self.name} needs accumulated attention: the cache did not keep attention_sum")
        scores = kv.attention_sum.float().clone()
        n_recent = self.n_recent_middle(target_len)
        if n_recent:
            scores[..., kv.length - n_recent :] = torch.inf
        return top_k_in_order(scores, target_len)

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        return kv.select(self.kept_index(kv, target_len))
