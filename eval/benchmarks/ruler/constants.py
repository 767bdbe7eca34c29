"""RULER's task table: templates, answer prefixes, generation lengths and per-task settings.

Benchmark constants reproduced as facts from NVIDIA/RULER (Apache-2.0):
`scripts/data/synthetic/constants.py` (templates, answer prefixes, tokens to generate) and
`scripts/synthetic.yaml` (the 13 task configurations). The answer prefix is kept apart from the
template, as the current reference does when it writes `answer_prefix` into each sample.
"""

from __future__ import annotations

from typing import Any

# Every needle, distractor needles included.
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

TEMPLATES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": (
            "Some special magic {type_needle_v} are hidden within the following text. "
            "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
            "{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
        ),
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": (
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above."
        ),
        "answer_prefix": (
            " Answer: According to the chain(s) of variable assignment in the text above, "
            "{num_v} variables are assigned the value {query}, they are: "
        ),
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n"
            "{context}\n"
            "Question: What are the 10 most common words in the above list?"
        ),
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. {context}\n"
            "Question: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?"
        ),
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": (
            "Answer the question based on the given documents. "
            "Only give me the answer and do not output any other words.\n\n"
            "The following are given documents.\n\n"
            "{context}\n\n"
            "Answer the question based on the given documents. "
            "Only give me the answer and do not output any other words.\n\n"
            "Question: {query}"
        ),
        "answer_prefix": " Answer:",
    },
}


def _niah(haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> dict[str, Any]:
    return {
        "task": "niah",
        "type_haystack": haystack,
        "type_needle_k": key,
        "type_needle_v": value,
        "num_needle_k": k,
        "num_needle_v": v,
        "num_needle_q": q,
    }


# scripts/synthetic.yaml
TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", q=4),
    "vt": {"task": "variable_tracking", "type_haystack": "noise", "num_chains": 1, "num_hops": 4},
    "cwe": {"task": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10, "num_fewshot": 1},
    "fwe": {"task": "freq_words_extraction", "alpha": 2.0, "coded_wordlen": 6},
    "qa_1": {"task": "qa", "dataset": "squad"},
    "qa_2": {"task": "qa", "dataset": "hotpotqa"},
}

TASK_NAMES: tuple[str, ...] = tuple(TASKS)
HUB_TASKS: tuple[str, ...] = ("qa_1", "qa_2")  # need SQuAD v2 / HotpotQA from the Hugging Face Hub
OFFLINE_TASKS: tuple[str, ...] = tuple(t for t in TASK_NAMES if t not in HUB_TASKS)

# Needle depths in percent: 40 evenly spaced values from 0 to 100, rounded
# (np.round(np.linspace(0, 100, num=40)) in the reference).
DEPTHS: tuple[int, ...] = tuple(int(round(100 * i / 39)) for i in range(40))


def max_new_tokens(task: str) -> int:
    """Tokens to generate for a RULER task (niah 128, vt 30, cwe 120, fwe 50, qa 32)."""
    return TEMPLATES[TASKS[task]["task"]]["tokens_to_generate"]
