"""RULER (NVIDIA/RULER), the 13 tasks generated locally at any length, in tokens of the model's
tokenizer; the protocol and metrics are in docs/benchmarks.md.

Its home: `constants` (the task table), `needles` (random keys and values), `qa` (SQuAD / HotpotQA
from the Hub), `tasks` (the builders and `generate_samples`), `scoring` (the reference's string
match), and here the benchmark and how it is reported. `python -m eval.benchmarks.ruler` prints
samples.

A length is RULER's sequence length: prompt + the task's new tokens fit in it. qa_1 and qa_2 need the
Hugging Face Hub: when it cannot be reached they are skipped with one line and the other tasks run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from centroidkv.errors import first_line
from eval.benchmarks import Benchmark, Report, Sample, register_benchmark
from eval.benchmarks.ruler.constants import HUB_TASKS, OFFLINE_TASKS, TASK_NAMES, TASKS, max_new_tokens
from eval.benchmarks.ruler.tasks import MIN_LENGTH, generate_samples

__all__ = [
    "HUB_TASKS",
    "OFFLINE_TASKS",
    "REPORT",
    "TASKS",
    "TASK_NAMES",
    "Ruler",
    "generate_samples",
    "max_new_tokens",
]

# The paper's column headers and task families.
REPORT = Report(
    title="RULER",
    task_labels={
        "niah_single_1": "S-NIAH-1",
        "niah_single_2": "S-NIAH-2",
        "niah_single_3": "S-NIAH-3",
        "niah_multikey_1": "MK-NIAH-1",
        "niah_multikey_2": "MK-NIAH-2",
        "niah_multikey_3": "MK-NIAH-3",
        "niah_multivalue": "MV-NIAH",
        "niah_multiquery": "MQ-NIAH",
        "vt": "VT",
        "cwe": "CWE",
        "fwe": "FWE",
        "qa_1": "QA-1",
        "qa_2": "QA-2",
    },
    families={
        "Single NIAH": ("niah_single_1", "niah_single_2", "niah_single_3"),
        "Multi-key NIAH": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
        "Multi-value / multi-query NIAH": ("niah_multivalue", "niah_multiquery"),
        "Variable tracking": ("vt",),
        "Aggregation (CWE, FWE)": ("cwe", "fwe"),
        "QA": ("qa_1", "qa_2"),
    },
)


@register_benchmark
@dataclass(frozen=True)
class Ruler(Benchmark):
    name = "ruler"
    length_is_tokens = True

    tasks: tuple[str, ...] = TASK_NAMES
    lengths: tuple[int, ...] = (4096,)
    n_samples: int = 50

    @classmethod
    def report(cls) -> Report:
        return REPORT

    def validate(self) -> list[str]:
        errors = super().validate()
        for task in self.tasks:
            if task not in TASK_NAMES:
                errors.append(
                    f"benchmark.tasks: unknown RULER task {task!r}; choose from {', '.join(TASK_NAMES)}"
                )
        for length in self.lengths:
            if isinstance(length, int) and 16 <= length < MIN_LENGTH:
                errors.append(f"benchmark.lengths: RULER needs lengths >= {MIN_LENGTH} tokens, got {length}")
        return errors

    @property
    def needs_hub(self) -> bool:
        return any(task in HUB_TASKS for task in self.tasks)

    def load(self, tokenizer) -> list[Sample]:
        samples = []
        for task in self.tasks:
            for length in self.lengths:
                try:
                    generated = generate_samples(
                        task, length, tokenizer, self.n_samples, seed=self.seed, split=self.split
                    )
                except RuntimeError as error:  # the hub tasks without the hub: skip them, run the others
                    if task not in HUB_TASKS:
                        raise
                    print(f"[skip] {task}: {first_line(error)}", file=sys.stderr)
                    continue
                samples.extend({**sample, "length": length} for sample in generated)
        if not samples:
            raise RuntimeError("no RULER samples could be generated")
        return samples

    def score(self, sample: Sample, prediction: str) -> float:
        from eval.benchmarks.ruler.scoring import ruler_score

        return float(ruler_score(sample["task"], prediction, sample["answers"]))

    def record_fields(self, sample: Sample, prediction: str, score: float) -> dict[str, Any]:
        """On the multikey tasks, `wrong_answer`: what a wrong prediction gave (`ruler.confusion`)."""
        from eval.benchmarks.ruler.confusion import confusable, wrong_answer_kind

        if not confusable(sample["task"]):
            return {}
        if score == 100:
            return {"wrong_answer": None}
        context = sample.get("context") or sample["input"]
        return {"wrong_answer": wrong_answer_kind(sample["task"], prediction, sample["answers"], context)}
