"""Needle in a haystack (`eval.niah`): one needle per depth x length of an essay haystack, for the
depth x length heatmap; scored by RULER's string match.

`length` is the target context length (the heatmap's column); `depths` are in percent of the haystack.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.benchmarks import Benchmark, Sample, register_benchmark
from eval.ruler.tasks import MIN_LENGTH


@register_benchmark
@dataclass(frozen=True)
class Niah(Benchmark):
    name = "niah"
    length_is_tokens = True

    tasks: tuple[str, ...] = ("niah",)
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0, 25, 50, 75, 100)
    max_new_tokens: int | None = 32

    def validate(self) -> list[str]:
        errors = super().validate()
        if self.tasks != ("niah",):
            errors.append(f"benchmark.tasks: NIAH has the one task niah, got {list(self.tasks)}")
        for length in self.lengths:
            if isinstance(length, int) and 16 <= length < MIN_LENGTH:
                errors.append(f"benchmark.lengths: NIAH needs lengths >= {MIN_LENGTH} tokens, got {length}")
        if not self.depths:
            errors.append("benchmark.depths: NIAH needs at least one needle depth")
        for depth in self.depths:
            if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 100:
                errors.append(f"benchmark.depths: each depth must be a percentage in [0, 100], got {depth!r}")
        return errors

    def n_expected_samples(self) -> int:
        return len(self.lengths) * len(self.depths) * self.n_samples

    def load(self, tokenizer) -> list[Sample]:
        from eval.niah import generate_niah

        samples = generate_niah(
            list(self.lengths),
            [float(d) for d in self.depths],
            tokenizer,
            seed=self.seed,
            n=self.n_samples,
            progress=False,
            split=self.split,
        )
        return [
            {**s, "task": s.get("task", "niah"), "length": s.get("target_length", s["length"])}
            for s in samples
        ]

    def score(self, sample: Sample, prediction: str) -> float:
        from eval.niah import niah_score

        return float(niah_score(prediction, sample["answers"]))
