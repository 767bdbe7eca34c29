"""Helpers shared by the benchmarks: tokenizer resolution, token counts, jsonl files, the fitting search."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the benchmarks call on a tokenizer: a Hugging Face one, or a test's light stand-in."""

    def __call__(self, text: str, **kwargs: Any) -> Mapping[str, Sequence[int]]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


def resolve_tokenizer(tokenizer: Tokenizer | str) -> Tokenizer:
    """A tokenizer object, or a model name of `centroidkv.models.loading` (then loaded, cached by that
    module)."""
    if isinstance(tokenizer, str):
        from centroidkv.models.loading import (
            load_tokenizer,  # imported late: model code is not needed otherwise
        )

        return load_tokenizer(tokenizer)
    return tokenizer


@contextmanager
def quiet_hub() -> Iterator[None]:
    """Silence the retry warnings of huggingface_hub/datasets, so that a failed download says one line."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "fsspec")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Number of tokens of `text`, without special tokens (BOS/EOS are the chat template's business)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def write_jsonl(samples: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line (UTF-8, non-ASCII kept), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a jsonl file written by `write_jsonl` (or LongBench's data files); blank lines are skipped."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def largest_fitting(
    measure: Callable[[int], int], budget: int, guess: int, minimum: int = 0, maximum: int | None = None
) -> int:
    """The largest size `minimum <= n <= maximum` with `measure(n) <= budget`, for a non-decreasing `measure`.

    `measure` is exact (a real tokenization) and costly, so the search extrapolates linearly through
    `guess`, brackets the answer with a few exact measurements around that estimate and bisects inside
    the bracket. Same result as RULER's bisection from scratch (NVIDIA/RULER
    `scripts/data/synthetic/niah.py`) in far fewer tokenizations. Returns `minimum` when nothing fits.
    """
    cache: dict[int, int] = {}

    def fits(n: int) -> bool:
        if n not in cache:
            cache[n] = measure(n)
        return cache[n] <= budget

    if not fits(minimum):
        return minimum
    top = maximum if maximum is not None else 1 << 62
    if top <= minimum:
        return minimum
    guess = min(max(guess, minimum + 1), top)
    fits(guess)
    slope = (cache[guess] - cache[minimum]) / (guess - minimum)
    if slope > 0:  # one secant step lands close to the answer
        guess = min(max(minimum + 1, minimum + int((budget - cache[minimum]) / slope)), top)
    step = max(1, guess // 64)
    if fits(guess):
        lo = guess
        while lo < top:
            hi = min(lo + step, top)
            if not fits(hi):
                break
            lo, step = hi, step * 2
        else:
            return top
    else:
        lo, hi = max(minimum, guess - step), guess
        while not fits(lo):
            hi, step = lo, step * 2
            lo = max(minimum, lo - step)
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
