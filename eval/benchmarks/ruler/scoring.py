"""RULER's scorer, equal to the reference: NVIDIA/RULER `scripts/eval/evaluate.py` (prediction clean-up)
and `scripts/eval/synthetic/constants.py` (string_match_all / string_match_part).

The per-sample metrics return 0-1 like the reference; `ruler_score` returns 0-100.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from eval.benchmarks.ruler.constants import TASKS, TEMPLATES

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_ruler_prediction(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, turn control characters into newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of the reference strings contained in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(1.0 if a.lower() in pred else 0.0 for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1 if any reference string is contained in the prediction (case-insensitive), else 0."""
    pred = prediction.lower()
    return max(1.0 if a.lower() in pred else 0.0 for a in answers)


def ruler_metric(task: str) -> Callable[[str, Sequence[str]], float]:
    """The metric of a RULER task (qa tasks: string_match_part; all others: string_match_all)."""
    if task in TASKS:
        kind = TASKS[task]["task"]
    elif task in TEMPLATES:  # a task kind (niah, variable_tracking, ..., qa)
        kind = task
    else:
        raise ValueError(f"unknown RULER task {task!r}")
    return string_match_part if kind == "qa" else string_match_all


def ruler_score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Score (0-100) of one RULER prediction; a task's score is the mean over its samples."""
    if not answers:
        raise ValueError("a RULER sample needs at least one reference answer")
    return 100.0 * ruler_metric(task)(clean_ruler_prediction(prediction), answers)
