"""RULER generator: determinism, lengths, construction (answers recoverable), CLI and hub failure."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from itertools import accumulate

import pytest

from eval.benchmarks.ruler import OFFLINE_TASKS, TASKS, generate_samples, max_new_tokens
from eval.benchmarks.ruler.__main__ import main as cli_main
from eval.benchmarks.ruler.constants import DEPTHS
from eval.common import count_tokens, largest_fitting, read_jsonl, write_jsonl
from eval.text import NOISE, split_sentences

LENGTHS = (4096, 8192)
N = 2


@pytest.fixture(scope="module")
def tok():
    from centroidkv.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def samples(tok):
    """Every offline task at 4k and 8k, generated once for all the tests of this module."""
    return {(t, n): generate_samples(t, n, tok, N, seed=0) for t in OFFLINE_TASKS for n in LENGTHS}


def test_task_table():
    assert len(TASKS) == 13 and len(OFFLINE_TASKS) == 11
    assert {t: max_new_tokens(t) for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")} == {
        "niah_single_1": 128,
        "vt": 30,
        "cwe": 120,
        "fwe": 50,
        "qa_1": 32,
    }
    assert DEPTHS[0] == 0 and DEPTHS[-1] == 100 and len(DEPTHS) == 40 and DEPTHS[1] == 3


# ----------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_same_seed_same_bytes_other_seed_differs(task, tok, samples):
    again = generate_samples(task, 4096, tok, N, seed=0)
    assert json.dumps(again) == json.dumps(samples[(task, 4096)])
    other = generate_samples(task, 4096, tok, 1, seed=1)
    assert other[0]["input"] != samples[(task, 4096)][0]["input"]
    assert samples[(task, 4096)][0]["input"] != samples[(task, 4096)][1]["input"]  # samples differ too


def test_global_random_state_is_left_alone(tok):
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_samples("niah_single_1", 2048, tok, 1)
    assert random.random() == expected


# ---------------------------------------------------------------------------------------------- length


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_length_fits_target(task, length, tok, samples):
    for s in samples[(task, length)]:
        assert s["input"] == s["context"] + s["question"]
        prompt = count_tokens(tok, s["input"] + s["answer_prefix"])
        # RULER's sequence length: prompt + new tokens <= target, and the haystack fills it to >= 95 %
        assert prompt + s["max_new_tokens"] == s["ruler_length"] <= length
        assert s["ruler_length"] >= 0.95 * length
        assert count_tokens(tok, s["input"]) == s["length"] <= length - s["max_new_tokens"]
        assert s["max_new_tokens"] == max_new_tokens(task)


# ----------------------------------------------------------------------------------------- construction

_NEEDLE = re.compile(r"One of the special magic (numbers|uuids|words) for (\S+) is: (\S+)\.")


def _haystack_units_before(s: dict, needle: str) -> tuple[int, int]:
    """(haystack units before the needle, haystack units in all), units as the generator counts them."""
    head = s["context"]
    cfg = TASKS[s["task"]]
    # the haystack starts after the template's first line ("... afterwards.\n")
    body = head[head.index("afterwards.\n") + len("afterwards.\n") :]
    others = [n for n in s["needles"] if n != needle]
    before_text = body[: body.index(needle)]
    if cfg["type_haystack"] == "essay":
        split = split_sentences
    else:
        split = lambda text: [u for u in text.split("\n") if u]  # noqa: E731
    before = [u for u in split(before_text) if u not in others]
    total = [u for u in split(body) if u not in s["needles"]]
    return len(before), len(total)


@pytest.mark.parametrize("task", [t for t in OFFLINE_TASKS if TASKS[t]["task"] == "niah"])
def test_niah_needles_verbatim_at_their_depth_and_answers_recoverable(task, samples):
    cfg = TASKS[task]
    for length in LENGTHS:
        for s in samples[(task, length)]:
            needles = s["needles"]
            assert len(needles) == cfg["num_needle_v"] * max(cfg["num_needle_k"], cfg["num_needle_q"])
            assert s["depths"] == sorted(s["depths"]) and set(s["depths"]) <= set(DEPTHS)
            for needle, depth in zip(needles, s["depths"], strict=True):
                assert s["context"].count(needle) == 1
                before, total = _haystack_units_before(s, needle)
                assert before == int(total * depth / 100)
            # answers = the values of the needles whose key is asked, in the order asked
            parsed = [_NEEDLE.fullmatch(n).groups() for n in needles]
            query = re.search(r"for (.+) mentioned in the provided text\?$", s["question"]).group(1)
            keys_asked = re.split(r", and |, ", query)
            assert len(set(keys_asked)) == cfg["num_needle_q"]
            assert set(keys_asked) <= {k for _, k, _ in parsed}
            assert sorted(s["answers"]) == sorted(v for _, k, v in parsed if k in keys_asked)
            kind = cfg["type_needle_v"]
            assert (f"magic {kind[:-1]} for" if len(s["answers"]) == 1 else f"magic {kind} for") in s[
                "question"
            ]
            # distractor needles never repeat the asked key
            found = [m.group(2) for m in _NEEDLE.finditer(s["context"])]
            assert all(found.count(k) == cfg["num_needle_v"] for k in keys_asked)


def test_niah_single_template_is_singular_and_multi_is_plural(samples):
    single = samples[("niah_single_1", 4096)][0]
    assert single["context"].startswith("A special magic number is hidden within the following text.")
    assert single["question"].startswith("\nWhat is the special magic number for ")
    assert single["answer_prefix"].endswith("mentioned in the provided text is")
    multi = samples[("niah_multivalue", 4096)][0]
    assert multi["context"].startswith("Some special magic numbers are hidden within the following text.")
    assert multi["answer_prefix"].endswith("mentioned in the provided text are")
    assert NOISE in single["context"]


def _resolve(assignments: dict[str, str], name: str) -> str:
    """Follow `VAR A = VAR B` links to the number a variable holds."""
    seen = set()
    while assignments[name].startswith("VAR "):
        assert name not in seen
        seen.add(name)
        name = assignments[name][4:]
    return assignments[name]


def test_vt_chain_resolves_to_the_answer(samples):
    for length in LENGTHS:
        for s in samples[("vt", length)]:
            value = re.search(r"assigned the value (\d+) in the text above", s["question"]).group(1)
            task_part = s["context"][s["context"].rindex("Memorize and track") :]  # after the worked example
            assignments = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", task_part))

            holders = [name for name in assignments if _resolve(assignments, name) == value]
            assert sorted(holders) == sorted(s["answers"]) and len(holders) == 5
            assert all(len(name) == 5 for name in holders)
            assert f"5 variables are assigned the value {value}" in s["answer_prefix"]
            example = s["context"][: s["context"].rindex("Memorize and track")]
            assert "they are: " in example and example.endswith("\n\n")  # the worked example shows the format


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_counts_match_the_answer(length, samples):
    for s in samples[("cwe", length)]:
        body = s["context"].split("Memorize the ones that appear most often.\n")[-1]
        # an entry runs to the next number: the vocabulary has multi-word entries ("ad hoc" besides "ad")
        entries = re.findall(r"(\d+)\. (.+?)(?= \d+\. |\n|$)", body)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        assert len(s["answers"]) == 10
        assert all(counts[w] == 30 for w in s["answers"])
        assert all(c == 3 for w, c in counts.items() if w not in s["answers"])
        example = s["context"].split("Memorize the ones that appear most often.\n")[1]
        assert "Answer: The top 10 words that appear most often in the list are: 1. " in example


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_counts_match_the_answer(length, samples):
    for s in samples[("fwe", length)]:
        text = s["context"].split("Find the three most frequently appeared coded words. ")[1]
        counts = Counter(text.split())
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == "..."
        assert s["answers"] == ranked[1:4]
        third = counts[s["answers"][2]]
        assert all(c < third for w, c in counts.items() if w not in s["answers"] and w != "...")
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in s["answers"])


# --------------------------------------------------------------------------------------------- helpers


def test_largest_fitting_finds_the_boundary():
    rng = random.Random(0)
    for _ in range(300):
        widths = [rng.randint(1, 80) for _ in range(2000)]
        prefix = [0, *accumulate(widths)]
        base, budget = rng.randint(0, 200), rng.randint(0, 90_000)
        expected = max((k for k in range(2001) if base + prefix[k] <= budget), default=0)
        got = largest_fitting(lambda k, b=base, p=prefix: b + p[k], budget, rng.randint(1, 3000), 0, 2000)
        assert got == expected


def test_jsonl_round_trip(tmp_path, samples):
    original = samples[("niah_multikey_3", 4096)]
    path = write_jsonl(original, tmp_path / "sub" / "s.jsonl")
    assert read_jsonl(path) == original


# -------------------------------------------------------------------------------------------- errors


def test_bad_arguments_raise_one_line(tok):
    for args in (("nope", 4096, 1), ("vt", 100, 1), ("vt", 4096, 0)):
        with pytest.raises(ValueError) as info:
            generate_samples(args[0], args[1], tok, args[2])
        assert "\n" not in str(info.value)


def test_cli_prints_samples_and_token_counts(capsys):
    assert cli_main(["--task", "niah_multikey_1", "--length", "2048", "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("===== niah_multikey_1 #") == 2
    assert re.search(r"tokens: input \d+, input \+ answer prefix \+ 128 new tokens \d+ / target 2048", out)


@pytest.mark.parametrize(
    "argv", [["--task", "nope", "--length", "4096"], ["--task", "vt", "--length", "abc"], ["--task", "vt"]]
)
def test_cli_bad_arguments_exit_2_with_one_line(argv):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "eval.benchmarks.ruler", *argv], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")


def test_qa_hub_failure_is_one_clear_line(monkeypatch):
    import datasets

    from eval.benchmarks.ruler import qa

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'rajpurkar/squad_v2' on the Hub\nmore details here")

    qa.load_qa.cache_clear()
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(RuntimeError) as info:
        generate_samples("qa_1", 4096, "not-even-a-tokenizer", 1)
    message = str(info.value)
    assert "\n" not in message and "rajpurkar/squad_v2" in message and "unreachable" in message


def test_qa_offline_hub_fails_fast_in_a_fresh_process():
    code = "from eval.benchmarks.ruler import generate_samples; generate_samples('qa_2', 4096, 'smollm2-135m', 1)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "RuntimeError: RULER hotpotqa data needs the Hugging Face Hub dataset 'hotpotqa/hotpot_qa'"
    )


# ------------------------------------------------------------------------------------------------ niah


def test_niah_grid_places_the_needle_at_each_depth(tok):
    from eval.benchmarks.niah import generate_niah, niah_grid, niah_score

    grid = generate_niah([2048, 4096], [0, 25, 100], tok, seed=3, progress=False)
    assert [(s["target_length"], s["depth"]) for s in grid] == [
        (n, d) for n in (2048, 4096) for d in (0, 25, 100)
    ]
    for s in grid:
        assert 0.95 * s["target_length"] <= s["ruler_length"] <= s["target_length"]
        body = s["context"][s["context"].index("afterwards.\n") + len("afterwards.\n") :]
        before = split_sentences(body[: body.index(s["needle"])])
        # the haystack's own sentences (its last one may be cut mid-sentence, so the needle is left out)
        total = len(split_sentences(body.replace(s["needle"], "", 1)))
        assert len(before) == int(total * s["depth"] / 100)
        assert s["answers"][0] in s["needle"] and s["question"].startswith(
            "\nWhat is the special magic number for "
        )
    scores = [
        niah_score(f"It is {s['answers'][0]}." if s["depth"] < 50 else "no idea", s["answers"]) for s in grid
    ]
    table = niah_grid(grid, scores)
    assert table == {
        "depths": [0, 25, 100],
        "lengths": [2048, 4096],
        "scores": [[100.0, 100.0], [100.0, 100.0], [0.0, 0.0]],
    }
    assert generate_niah([2048], [50], tok, seed=3, progress=False) == generate_niah(
        [2048], [50], tok, seed=3, progress=False
    )


# -------------------------------------------------------------------------------------- qa (fake hub)


def _fake_squad() -> list[dict]:
    rng = random.Random(7)
    rows = []
    for article in range(30):
        for p in range(3):
            context = f"Article {article} paragraph {p}. " + " ".join(
                rng.choice(["river", "stone", "market", "winter", "engine", "garden"]) for _ in range(40)
            )
            answers = [] if p == 2 else [f"answer-{article}-{p}"]
            rows.append(
                {
                    "title": f"T{article}",
                    "context": context,
                    "question": f"Q{article}.{p}?",
                    "answers": {"text": answers},
                }
            )
    return rows


def _fake_hotpot() -> list[dict]:
    rows = []
    for q in range(40):
        titles = [f"Doc{q}-{i}" for i in range(10)]
        sentences = [[f"Sentence about {t}. ", "More words here."] for t in titles]
        rows.append(
            {
                "question": f"Question {q}?",
                "answer": f"ans{q}",
                "context": {"title": titles, "sentences": sentences},
            }
        )
    return rows


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_from_a_fake_hub(task, tok, monkeypatch):
    import datasets

    from eval.benchmarks.ruler import qa

    fake = {"rajpurkar/squad_v2": _fake_squad(), "hotpotqa/hotpot_qa": _fake_hotpot()}
    qa.load_qa.cache_clear()
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config=None, split=None: fake[repo])
    try:
        samples = generate_samples(task, 2048, tok, 3, seed=0)
        assert json.dumps(samples) == json.dumps(generate_samples(task, 2048, tok, 3, seed=0))
    finally:
        qa.load_qa.cache_clear()
    items, docs = qa.load_qa.__wrapped__("squad" if task == "qa_1" else "hotpotqa")
    for s in samples:
        asked = [item for item in items if s["question"].endswith(f"Question: {item.query}")]
        assert len(asked) == 1  # the sample's question is one of the dataset's
        item = asked[0]
        assert s["answers"] == item.answers
        for gold in item.gold:
            assert f":\n{docs[gold]}" in s["context"]  # every gold document is present verbatim
        numbers = [int(n) for n in re.findall(r"^Document (\d+):$", s["context"], flags=re.M)]
        assert numbers == list(range(1, len(numbers) + 1))
        assert 0.95 * 2048 <= s["ruler_length"] <= 2048 and s["max_new_tokens"] == 32
        assert s["answer_prefix"] == " Answer:"


# ------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    "task, answers, prediction, expected",
    [
        ("qa_1", ["answer-3-1", "Answer 3.1"], "I think answer-3-1.", 100.0),  # any reference: part match
        ("qa_1", ["answer-3-1"], "answer-3-2", 0.0),
        ("qa_2", ["ans1"], "The answer is ANS12", 100.0),  # RULER's containment rule, case-insensitive
        ("niah_multivalue", ["1234567", "7654321", "1111111", "2222222"], "1234567, 2222222", 50.0),  # all
        ("niah_single_1", ["7654321"], "76543 21", 0.0),
        ("vt", ["ABCDE", "FGHIJ"], " abcde fghij\n", 100.0),
        ("cwe", ["apple", "pear", "plum"], "apple pear", 200 / 3),
    ],
)
def test_ruler_benchmark_scores_hand_made_predictions(task, answers, prediction, expected):
    from eval.benchmarks.ruler import Ruler

    assert Ruler().score({"task": task, "answers": answers}, prediction) == pytest.approx(expected)
