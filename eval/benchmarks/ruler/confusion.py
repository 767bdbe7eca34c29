"""What a wrong needle answer gave instead: the question a merging method must answer.

Merging averages the keys of similar tokens; if it blends the keys of two needles, the model answers
with the wrong needle's value. For a wrong answer on a task whose haystack holds several needles
(`niah_multikey_*`), `wrong_answer_kind` says which of three things the prediction holds:

- "distractor": the value of another needle in the prompt (the confusion merging is suspected of);
- "absent": a value of the needles' kind (a number, a UUID) that is nowhere among the prompt's needles;
- "no_value": no such value at all (an empty or wordy answer).

Needles are found in the prompt by RULER's needle sentence (`constants.NEEDLE`), so the distractor
needles of a needle haystack count as much as the extra needles of an essay haystack.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from eval.benchmarks.ruler.constants import NEEDLE, TASKS

KINDS: tuple[str, ...] = ("distractor", "absent", "no_value")
VALUE_PATTERNS: dict[str, str] = {
    "numbers": r"\d+",
    "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}
_NEEDLE = re.compile(
    re.escape(NEEDLE)
    .replace(re.escape("{type_needle_v}"), r"(?:\w+)")
    .replace(re.escape("{key}"), r"(?:.+?)")
    .replace(re.escape("{value}"), r"(?P<value>\S+?)")
    .rstrip(r"\.")
    + r"\."
)


def confusable(task: str) -> bool:
    """Whether a task's prompt holds needles other than the asked one (the multikey tasks)."""
    spec = TASKS.get(task, {})
    return spec.get("task") == "niah" and (spec["num_needle_k"] > 1 or spec["type_haystack"] == "needle")


def needle_values(context: str) -> set[str]:
    """Every value stated by a needle sentence in `context`."""
    return {match.group("value").lower() for match in _NEEDLE.finditer(context)}


def wrong_answer_kind(task: str, prediction: str, answers: Sequence[str], context: str) -> str:
    """ "distractor", "absent" or "no_value" for a wrong `prediction` on `task` (module docstring)."""
    pattern = VALUE_PATTERNS[TASKS[task]["type_needle_v"]]
    given = set(re.findall(pattern, prediction.lower()))
    wrong = given - {answer.lower() for answer in answers}
    if wrong & needle_values(context):
        return "distractor"
    return "absent" if wrong else "no_value"
