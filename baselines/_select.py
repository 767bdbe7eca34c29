"""Helpers shared by the score-based baselines: top-k selection with a documented tie rule."""

from __future__ import annotations

from torch import Tensor


def top_k_in_order(scores: Tensor, k: int) -> Tensor:
    """Indices ([..., k]) of the k highest scores along the last axis, returned in sequence order.

    Ties are broken towards the *earlier* token: a stable descending sort keeps equal scores in
    their original (positional) order. Keeping the survivors in sequence order matters for methods
    that look at positions later (StreamingLLM's "newest", SnapKV's pooling, CaM's neighbours).
    """
    order = scores.float().argsort(dim=-1, descending=True, stable=True)
    return order[..., :k].sort(dim=-1).values
