"""RULER (NVIDIA/RULER), generated locally by `eval.ruler` at each length, in tokens of the model's
tokenizer; the protocol and metrics are in docs/benchmarks.md.

A length is RULER's sequence length: prompt + the task's new tokens fit in it. qa_1 and qa_2 need the
Hugging Face Hub: when it cannot be reached they are skipped with one line and the other tasks run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from eval.benchmarks import Benchmark, Sample, register_benchmark
from eval.ruler import HUB_TASKS, TASK_NAMES, generate_samples
from eval.ruler.tasks import MIN_LENGTH


@register_benchmark
@dataclass(frozen=True)
class Ruler(Benchmark):
    name = "ruler"
    length_is_tokens = True

    tasks: tuple[str, ...] = TASK_NAMES
    lengths: tuple[int, ...] = (4096,)
    n_samples: int = 50

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
                    print(f"[skip] {task}: {str(error).splitlines()[0]}", file=sys.stderr)
                    continue
                samples.extend({**sample, "length": length} for sample in generated)
        if not samples:
            raise RuntimeError("no RULER samples could be generated")
        return samples

    def score(self, sample: Sample, prediction: str) -> float:
        from eval.metrics import ruler_score

        return float(ruler_score(sample["task"], prediction, sample["answers"]))
