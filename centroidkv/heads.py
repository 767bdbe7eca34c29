"""Head policies: which (layer, KV head) pairs a method treats apart, and how.

Every compression method takes a head policy (the `heads*` parameters of `centroidkv.methods.Method`):

  none:   every KV head is compressed by the method to the layer's budget B.
  whole:  the listed heads keep every entry and are never compressed (DuoAttention's retrieval heads,
          CentroidKV's outlier heads); the other heads are compressed to B.
  budget: every head is compressed by the method; the listed heads get `heads_boost` times the
          entries of the others (at most the full length), a two-tier version of AdaKV's per-head
          budgets: the listed heads get more, not everything.

Whatever a policy keeps counts inside the budget: in bytes, B is solved with the listed heads' entries
included (`CompressedCache`), so a policy changes where the bytes go, never how many there are.

The listed heads are the worst `heads_fraction` of all (layer, KV head) pairs by a calibrated score,
read from a head file (`centroidkv.calibrate`). `heads_file` names the score, or a file:

  clustering: (the default) the relative error of each head's attention output on dev essays when
              the head is clustered by CentroidKV's defaults (the paper's outlier heads). Measured with
              one method's compression, but one fixed list applied alike to every method, and on the
              embedded model the only list of the three that helps any method (docs/results.md);
  needle:     the attention mass the question puts on the answer's tokens in dev needle prompts: the
              retrieval heads, a property of the model, independent of any method;
  streaming:  the relative error of each head's attention output, on the same prompts, when it keeps
              only sinks and a recent window: DuoAttention's criterion, also method-independent;
  a path:     a JSON file written by `python -m eval.calibrate`.
"""

from __future__ import annotations

import math
from pathlib import Path

from centroidkv.calibrate import HEAD_SCORES

HEAD_POLICIES = ("none", "whole", "budget")


def check_head_source(policy: str, head_file: str | Path) -> None:
    """One ValueError line for a head file that a policy would read and that is missing or malformed
    (the policy, the score's name or path, the fraction and the boost are rules of the method's fields:
    `centroidkv.methods.Method`)."""
    if policy != "none" and str(head_file) not in HEAD_SCORES:
        from centroidkv.calibrate import read_head_file

        read_head_file(head_file)  # a missing or malformed file fails here, with one line


def favoured_len(budget_len: int, boost: float, full_len: int) -> int:
    """Entries per listed head under the `budget` policy: boost x B, at most the full length."""
    return min(full_len, max(budget_len, math.ceil(boost * budget_len)))


def compressed_fraction(ratio: float, listed_fraction: float, boost: float = math.inf) -> float:
    """The share of its full length each other head keeps when a fraction `listed_fraction` of all KV
    heads is listed and keeps `boost` times as much (inf: everything, the `whole` policy), for a total
    of `ratio` of a full cache. An estimate that ignores per-entry records (used to check
    configurations before a model loads). Raises ValueError when the listed heads alone take the budget.
    """
    if listed_fraction == 0:
        return ratio
    if math.isfinite(boost) and boost * ratio / (1 - listed_fraction + boost * listed_fraction) <= 1:
        return ratio / (1 - listed_fraction + boost * listed_fraction)
    if listed_fraction >= ratio:
        raise ValueError(
            f"its heads kept whole alone take {listed_fraction:.1%} of a full cache's bytes, not less than "
            f"the budget {ratio:g}; raise the budget, keep fewer heads whole (heads_fraction), use "
            "heads=budget or budget_unit=entries"
        )
    return (ratio - listed_fraction) / (1 - listed_fraction)
