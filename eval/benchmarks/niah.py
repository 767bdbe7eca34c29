"""Needle in a haystack: one needle at chosen depths of a Paul Graham essay haystack, at chosen lengths.

The grid behind the classic depth x length heatmap (gkamradt/LLMTest_NeedleInAHaystack), built with
RULER's needle, template and length accounting (the niah_single_2 task with the depth fixed rather than
drawn), so that a cell is scored by RULER's string match of the 7-digit value. A sample's seed, needle
key and value and essays belong to its split (`dev` or `test`; see `eval.benchmarks.split_index`).

`length` is the target context length (the heatmap's column); `depths` are in percent of the haystack.
Reported as the default tables plus the depth x length heatmap.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from centroidkv.models.model_names import EMBEDDED_MODEL
from eval.benchmarks import Benchmark, Report, Sample, check_split, register_benchmark, split_seed
from eval.benchmarks.ruler.constants import NEEDLE, max_new_tokens
from eval.benchmarks.ruler.needles import random_key_word, random_number
from eval.benchmarks.ruler.scoring import ruler_score
from eval.benchmarks.ruler.tasks import MIN_LENGTH, Built, render
from eval.common import Tokenizer, count_tokens, largest_fitting, resolve_tokenizer
from eval.text import essay_text, insert_at_depths, split_sentences

REPORT = Report(title="Needle in a haystack", heatmap=True)

DEFAULT_DEPTHS: tuple[float, ...] = tuple(float(d) for d in range(0, 101, 10))
MAX_NEW_TOKENS = max_new_tokens("niah_single_2")


def _builder(seed: str, depth: float, split: str):
    rng = random.Random(seed)
    key, value = random_key_word(rng, split), random_number(rng, split)
    needle = NEEDLE.format(type_needle_v="numbers", key=key, value=value)

    def build(size: int) -> Built:
        sentences = split_sentences(essay_text(size, split))
        text = " ".join(insert_at_depths(sentences, [needle], [depth]))
        return Built(
            text, key, [value], fields={"type_needle_v": "number"}, single=True, extra={"needle": needle}
        )

    return build


def generate_niah(
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    tokenizer: Tokenizer | str = EMBEDDED_MODEL,
    seed: int = 0,
    n: int = 1,
    progress: bool = True,
    split: str = "test",
) -> list[dict[str, Any]]:
    """`n` samples of `split` ("dev" or "test") per (length, depth) cell; depth in percent of the
    haystack's sentences.

    Samples have the keys of RULER's `generate_samples` (task "niah") plus depth and needle; the
    prompt plus max new tokens fits each length, as RULER counts it.
    """
    if not lengths or any(not isinstance(n_, int) or n_ < MIN_LENGTH for n_ in lengths):
        raise ValueError(f"lengths must be integers >= {MIN_LENGTH}, got {list(lengths)!r}")
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"depths must be percentages in [0, 100], got {list(depths)!r}")
    check_split(split)
    tok = resolve_tokenizer(tokenizer)
    cells = [(length, depth, i) for length in lengths for depth in depths for i in range(n)]
    samples: list[dict[str, Any]] = []
    guesses: dict[int, int] = {}
    for length, depth, i in tqdm(cells, desc="niah grid", disable=not progress):
        build = _builder(split_seed(split, "niah", seed, length, depth, i), depth, split)
        budget = length - MAX_NEW_TOKENS

        def measure(size: int, build=build) -> int:
            r = render("niah", build(size))
            return count_tokens(tok, r.input + r.answer_prefix)

        size = largest_fitting(measure, budget, guess=guesses.get(length, int(budget / 1.3)))
        guesses[length] = size
        built = build(size)
        r = render("niah", built)
        prompt_tokens = count_tokens(tok, r.input + r.answer_prefix)
        samples.append(
            {
                "task": "niah",
                "index": len(samples),
                "input": r.input,
                "context": r.context,
                "question": r.question,
                "answer_prefix": r.answer_prefix,
                "answers": built.answers,
                "max_new_tokens": MAX_NEW_TOKENS,
                "length": count_tokens(tok, r.input),
                "ruler_length": prompt_tokens + MAX_NEW_TOKENS,
                "target_length": length,
                "depth": depth,
                "seed": seed,
                "split": split,
                "use_chat_template": True,
                "haystack_size": size,
                **built.extra,
            }
        )
    return samples


def niah_score(prediction: str, answers: Sequence[str]) -> float:
    """100 when the needle's value is in the prediction (RULER's string match), else 0."""
    return ruler_score("niah", prediction, answers)


def niah_grid(samples: Sequence[dict[str, Any]], scores: Sequence[float]) -> dict[str, Any]:
    """Mean score per cell, laid out for a heatmap: depths (rows) x lengths (columns)."""
    cells: dict[tuple[float, int], list[float]] = defaultdict(list)
    for sample, score in zip(samples, scores, strict=True):
        cells[(sample["depth"], sample["target_length"])].append(score)
    depths = sorted({d for d, _ in cells})
    lengths = sorted({n for _, n in cells})
    matrix = [[_mean(cells.get((d, n), [])) for n in lengths] for d in depths]
    return {"depths": depths, "lengths": lengths, "scores": matrix}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@register_benchmark
@dataclass(frozen=True)
class Niah(Benchmark):
    name = "niah"
    length_is_tokens = True
    sample_choice = Benchmark.sample_choice | {"depths"}  # each record names its depth

    tasks: tuple[str, ...] = ("niah",)
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[float, ...] = (0, 25, 50, 75, 100)
    max_new_tokens: int | None = 32

    @classmethod
    def report(cls) -> Report:
        return REPORT

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
        return float(niah_score(prediction, sample["answers"]))
