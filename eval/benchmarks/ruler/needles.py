"""Random needle parts for RULER: word lists, keys, numbers, uuids, variable names.

Source as in NVIDIA/RULER `scripts/data/synthetic/`: the noun/adjective/verb lists of `wonderwords`
(the essay haystack and the noise filler are shared text, in `eval.text`).

Splits: everything a sample draws from here belongs to its split (`dev` or `test`), by the one rule
of `eval.benchmarks.split_index`: number the space, dev takes the even numbers and test the odd ones.
The numbering of each space: a 7-digit number is its offset from 1,000,000 (dev: even numbers); an
adjective-noun key its index among the sorted pairs; a UUID its 128-bit integer (dev: an even last
hex digit); a variable name its value in base 26 (A = 0); an essay its position among the sorted
files (see `eval.text`).
"""

from __future__ import annotations

import random
import string
import uuid
from functools import cache

from wonderwords.random_word import _get_words_from_text_file

from eval.benchmarks import split_index


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
