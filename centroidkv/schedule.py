"""Merge-count schedules for the rounds of one compression call.

Chunked Soft Matching merges at most half of the tokens per round (only A tokens disappear), so a
compression takes several rounds; a schedule says how many A tokens round j merges. Every schedule
merges at least one token per round and never more than the excess, so the budget is always reached.

- `LinearSchedule` (the paper): r_j = r_init - j * delta_r, clamped to [r_min, 1]; round j merges
  floor(r_j * |A|) tokens. Constant when delta_r = 0.
- `AdaptiveSchedule` (ours; the paper names a hand-set schedule as a limitation): round j merges the A
  tokens whose best-edge similarity is at least the mean of that round's best-edge similarities
  (per head, averaged over the heads so tensors stay rectangular), but at least floor(r_min * |A|).
  The data decide: when a few edges stand out (a skewed distribution), few merge; when most tokens
  have a near-duplicate, many do. No per-model constant; r_min only bounds the number of rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class LinearSchedule:
    r_init: float
    delta_r: float
    r_min: float

    def rate(self, round_idx: int) -> float:
        """The fraction of A tokens that round `round_idx` (0-based) may merge."""
        return min(1.0, max(self.r_min, self.r_init - round_idx * self.delta_r))

    def merge_count(self, round_idx: int, best_score: Tensor, n_pairs: int, excess: int) -> int:
        """Tokens round `round_idx` merges; `best_score` [B, H, A] (unused here, -inf for padding)."""
        return min(excess, max(1, int(self.rate(round_idx) * n_pairs)))


@dataclass(frozen=True)
class AdaptiveSchedule:
    r_min: float

    def merge_count(self, round_idx: int, best_score: Tensor, n_pairs: int, excess: int) -> int:
        """Edges at or above their head's mean best-edge similarity (padding slots excluded), averaged
        over (batch, head), at least floor(r_min * |A|), at most the excess and |A|."""
        real = best_score.isfinite()
        scores = best_score.float().nan_to_num(neginf=0.0)
        mean = (scores * real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1)
        above = ((scores >= mean) & real).sum(-1).float().mean()
        return min(excess, n_pairs, max(1, int(self.r_min * n_pairs), int(above)))
