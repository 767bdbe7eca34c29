"""CaM: cache merging. The values of evicted tokens are merged into kept neighbours, with a
probability set by how much attention the evicted token received.

Paper: Zhang, Du, Luo, Zhong, Zhang, Liu, Ji, "CaM: Cache Merging for Memory-efficient LLMs
Inference", ICML 2024 (PMLR 235:58840-58850; code github.com/zyxxmu/cam). Eviction alone perturbs
the attention output; CaM merges each to-be-evicted value into the remaining cache instead, with a
sampling strategy driven by the prominence of the evicted token's attention among its merge targets.

This implementation (the CentroidKV paper's v1 baseline, run in our cache during prefill and every g
decoding steps), per (batch, KV head) of the mergeable middle:
1. Eviction: H2O's rule (accumulated attention `attention_sum`, the budget split by `recent_ratio`;
   see `baselines.h2o`) picks the `target_len` kept tokens.
2. Merge window of an evicted token e: the `merge_budget` (m) kept tokens that follow it in the
   sequence; when fewer than m kept tokens follow inside the middle, the window is the last m kept
   tokens (the protected recent window is never modified).
3. Merge probability p_e = clamp(A_e / mean(A_window), 0, 1), A the accumulated attention; a
   Bernoulli draw (generator seeded by `seed`, the layer and the segment length) decides whether e
   is merged.
4. Merge: every value of the window gets + V_e / m (the paper's uniform split over the window).
   Keys are not changed; evicted tokens are then dropped.

Degrees: CaM's merged value is an additive correction, not a centroid, and the paper's attention has
no degree term, so kept tokens keep their log-degree (0): `merges` is False and attention is exactly
what the CaM paper computes. (It is sometimes grouped with the merging methods that update
log_degree; adding log n here would double-count the merged tokens.)

Parameters:
  merge_budget: m, kept neighbours an evicted value is spread over (kvpress's CAMPress: 32).
  seed: seed of the Bernoulli draws.
  recent_ratio, n_sink, n_recent, compress_interval: as H2O (0.5, 0, 64, 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.h2o import H2O
from centroidkv.methods import LayerKV, LayerStats, param, register


@register
@dataclass
class CaM(H2O):
    name = "cam"
    label = "CaM"

    merge_budget: int = param(32, minimum=1)
    seed: int = param(0, minimum=0)

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        batch, heads, length = kv.log_degree.shape
        kept = self.kept_index(kv, target_len)  # [B, H, K] sorted
        is_kept = torch.zeros(batch, heads, length, dtype=torch.bool, device=kept.device).scatter_(
            2, kept, True
        )
        evicted = (
            (~is_kept)
            .to(torch.int8)
            .argsort(dim=-1, descending=True, stable=True)[..., : length - target_len]
        )
        evicted = evicted.sort(dim=-1).values  # [B, H, E]

        window = min(self.merge_budget, target_len)
        start = torch.searchsorted(kept, evicted).clamp(max=target_len - window)  # first kept token after e
        slots = start.unsqueeze(-1) + torch.arange(window, device=kept.device)  # [B, H, E, m] ranks in `kept`
        targets = kept.gather(2, slots.flatten(2)).view_as(slots)  # positions in the middle

        attention = kv.attention_sum.float()
        window_mean = attention.gather(2, targets.flatten(2)).view_as(targets).mean(dim=-1)
        probability = (attention.gather(2, evicted) / window_mean).nan_to_num(nan=0.0, posinf=1.0).clamp(0, 1)
        generator = torch.Generator().manual_seed(hash((self.seed, stats.layer_idx, length)) % (2**63))
        merged = torch.bernoulli(probability.cpu(), generator=generator).to(probability.device)

        head_dim = kv.values.shape[-1]
        share = kv.values.float().gather(2, evicted.unsqueeze(-1).expand(-1, -1, -1, head_dim))
        share = share * (merged / window).unsqueeze(-1)  # [B, H, E, D]
        contribution = share.unsqueeze(3).expand(-1, -1, -1, window, -1).reshape(batch, heads, -1, head_dim)
        values = kv.values.float().scatter_add(
            2, targets.flatten(2).unsqueeze(-1).expand(-1, -1, -1, head_dim), contribution
        )
        merged_kv = LayerKV(kv.keys, values.to(kv.values.dtype), kv.log_degree, kv.extras)
        return merged_kv.select(kept)
