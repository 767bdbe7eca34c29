"""Merge-rate schedules for the rounds of one compression call.

Chunked Soft Matching merges at most a fraction r of the A tokens per round. The paper anneals r
linearly over the rounds of one compression (r_j = r_init - j * delta_r), so later rounds only merge
the most confident pairs; we clamp r_j to [r_min, 1] so the budget is always reachable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearSchedule:
    r_init: float
    delta_r: float
    r_min: float

    def rate(self, round_idx: int) -> float:
        """The fraction of A tokens that round `round_idx` (0-based) may merge."""
        return min(1.0, max(self.r_min, self.r_init - round_idx * self.delta_r))
