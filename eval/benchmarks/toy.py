"""Toy: a tiny self-contained key-value recall task (no data, no generator package), for smoke tests.

Each sample hides "The special magic number for <word> is: <7 digits>." at a random depth of a
repeated filler text of about `length` tokens and asks for the number; scored by string match. The
splits draw keys from alternate words of WORDS and numbers of their own parity (`split_index`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from eval.benchmarks import Benchmark, Sample, register_benchmark, split_index
from eval.text import NOISE

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
FILLER = NOISE + " "


@register_benchmark
@dataclass(frozen=True)
class Toy(Benchmark):
    name = "toy"

    tasks: tuple[str, ...] = ("toy",)
    lengths: tuple[int, ...] = (256,)
    n_samples: int = 2
    max_new_tokens: int | None = 8

    def load(self, tokenizer) -> list[Sample]:
        samples = []
        for task in self.tasks:
            for length in self.lengths:
                rng = random.Random(self.sample_seed(task, length))
                for index in range(self.n_samples):
                    key = WORDS[split_index(rng, len(WORDS), self.split)]
                    value = str(10**6 + split_index(rng, 9 * 10**6, self.split))
                    needle = f"The special magic number for {key} is: {value}. "
                    n_fill = max(1, length // 24)
                    depth = rng.randrange(n_fill)
                    context = FILLER * depth + needle + FILLER * (n_fill - depth)
                    question = f"What is the special magic number for {key}?"
                    samples.append(
                        dict(
                            task=task,
                            index=index,
                            input=context + "\n" + question,
                            context=context,
                            question=question,
                            answer_prefix=" Answer:",
                            answers=[value],
                            max_new_tokens=12,
                            length=length,
                            split=self.split,
                        )
                    )
        return samples

    def score(self, sample: Sample, prediction: str) -> float:
        """Percentage of the answers contained in the prediction (case-insensitive, printable text)."""
        text = "".join(ch for ch in prediction if ch.isprintable() or ch in "\n\t").lower()
        hits = [str(answer).lower() in text for answer in sample["answers"]]
        return 100.0 * sum(hits) / max(1, len(hits))
