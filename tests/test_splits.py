"""Dev and test splits: every generated benchmark draws disjoint samples for `split=dev` and `split=test`
(no shared seed, needle value, needle key or essay), the outlier-head calibration reads the dev essays
only, and a bad split is one validation line."""

from __future__ import annotations

import random
import re
import uuid
from pathlib import Path

import pytest
import yaml

from eval.benchmarks import SPLITS, build_benchmark, split_index
from eval.benchmarks.niah import generate_niah
from eval.benchmarks.ruler import OFFLINE_TASKS, TASKS, generate_samples, needles
from eval.benchmarks.toy import WORDS, Toy
from eval.text import essay_files, essay_words, split_sentences

LENGTH = 1024
N = 2
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiment"
_NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids|words) for (\S+) is: (\S+)\.")
_VAR = re.compile(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))")


class _SeedSpy(random.Random):
    """A `random.Random` that records the seed of every generator made while it is patched in."""

    seeds: list[object] = []

    def __init__(self, seed: object = None) -> None:
        _SeedSpy.seeds.append(seed)
        super().__init__(seed)


@pytest.fixture(scope="module")
def tok():
    from centroidkv.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def generated(tok) -> dict[str, dict]:
    """Per split: the RULER samples of every offline task, NIAH and toy samples, and the seed of every
    random generator made to build them."""
    generate_samples("vt", LENGTH, tok, 1)  # sizes vt's worked example once (a probe, not a sample)
    out = {}
    for split in SPLITS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(random, "Random", _SeedSpy)
            _SeedSpy.seeds = []
            ruler = {task: generate_samples(task, LENGTH, tok, N, split=split) for task in OFFLINE_TASKS}
            niah = generate_niah([LENGTH], [0, 50, 100], tok, n=1, progress=False, split=split)
            toy = Toy(n_samples=20, split=split).load(tok)
            out[split] = {"ruler": ruler, "niah": niah, "toy": toy, "seeds": list(_SeedSpy.seeds)}
    return out


def _needles(samples: list[dict]) -> tuple[set[str], set[str]]:
    """(keys, values) of every needle in the samples' contexts, distractors included."""
    found = [m.groups() for s in samples for m in _NEEDLE.finditer(s["context"])]
    return {key for key, _ in found}, {value for _, value in found}


def _chains(samples: list[dict]) -> tuple[set[str], set[str]]:
    """(variable names, chain values) of every vt statement, the worked examples' included."""
    found = [m.groups() for s in samples for m in _VAR.finditer(s["context"])]
    names = {name for name, *_ in found} | {source for _, source, _ in found if source}
    return names, {value for *_, value in found if value}


# ------------------------------------------------------------------------------------------ seeds


def test_no_random_generator_seed_is_shared_between_the_splits(generated):
    dev, test = (set(generated[split]["seeds"]) for split in SPLITS)
    assert len(dev) > 50 and len(test) > 50  # the spy saw the generators
    assert None not in dev | test  # every generator is seeded
    assert dev.isdisjoint(test)


# ------------------------------------------------------------------------------------------- RULER


def test_ruler_splits_share_no_needle_key_or_value(generated):
    dev = [s for task in OFFLINE_TASKS for s in generated["dev"]["ruler"][task]]
    test = [s for task in OFFLINE_TASKS for s in generated["test"]["ruler"][task]]
    (dev_keys, dev_values), (test_keys, test_values) = _needles(dev), _needles(test)
    assert len(dev_keys) > 20 and len(test_values) > 20
    assert dev_keys.isdisjoint(test_keys) and dev_values.isdisjoint(test_values)
    assert dev_keys.isdisjoint(test_values) and dev_values.isdisjoint(test_keys)  # uuids are both
    (dev_names, dev_chain_values), (test_names, test_chain_values) = _chains(dev), _chains(test)
    assert len(dev_names) >= 10 and dev_chain_values and test_chain_values
    assert dev_names.isdisjoint(test_names) and dev_chain_values.isdisjoint(test_chain_values)


def test_ruler_needle_numbers_and_uuids_follow_the_parity_rule(generated):
    for parity, split in enumerate(SPLITS):  # dev: even, test: odd
        samples = [s for task in OFFLINE_TASKS for s in generated[split]["ruler"][task]]
        keys, values = _needles(samples)
        numbers = [int(v) for v in values if v.isdigit()]
        uuids = [uuid.UUID(v) for v in keys | values if "-" in v and len(v) == 36]
        assert numbers and uuids
        assert {n % 2 for n in numbers} == {parity} and {u.int % 2 for u in uuids} == {parity}
        assert all(u.version == 4 for u in uuids)


@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_ruler_dev_and_test_samples_differ(task, generated):
    dev, test = (generated[split]["ruler"][task] for split in SPLITS)
    assert {s["split"] for s in dev} == {"dev"} and {s["split"] for s in test} == {"test"}
    assert {s["input"] for s in dev}.isdisjoint(s["input"] for s in test)
    assert {tuple(s["answers"]) for s in dev}.isdisjoint(tuple(s["answers"]) for s in test)


def _longest_essay_sentence(sample: dict) -> str:
    """The longest haystack sentence of an essay-haystack sample (needles left out): unique to its essay."""
    body = sample["context"][sample["context"].index("afterwards.\n") + len("afterwards.\n") :]
    return max((u for u in split_sentences(body) if not _NEEDLE.search(u)), key=len)


def test_ruler_essay_haystacks_come_from_their_split_s_essays(generated):
    text = {split: " ".join(essay_words(split)) for split in SPLITS}
    essay_tasks = [t for t in OFFLINE_TASKS if TASKS[t].get("type_haystack") == "essay"]
    for split, other in (SPLITS, SPLITS[::-1]):
        for task in essay_tasks:
            sentence = _longest_essay_sentence(generated[split]["ruler"][task][0])
            assert len(sentence) > 100
            assert sentence in text[split] and sentence not in text[other]


def test_ruler_qa_splits_ask_different_questions(tok, monkeypatch):
    from eval.benchmarks.ruler import tasks
    from eval.benchmarks.ruler.qa import QAItem

    items = [QAItem(query=f"Question {i}?", answers=[f"answer {i}"], gold=[i]) for i in range(20)]
    docs = [f"Document body {i}. " + "filler words here. " * 10 for i in range(20)]
    monkeypatch.setattr(tasks, "load_qa", lambda dataset: (items, docs))
    asked = {
        split: {s["question"] for s in generate_samples("qa_1", LENGTH, tok, 4, split=split)}
        for split in SPLITS
    }
    assert len(asked["dev"]) == len(asked["test"]) == 4
    assert asked["dev"].isdisjoint(asked["test"])


def test_value_spaces_are_partitioned_between_the_splits():
    """Many draws (collisions would be certain without the partition), every needle kind."""
    draws = 20_000
    for kind in ("numbers", "words"):
        rngs = {split: random.Random(f"draws:{split}") for split in SPLITS}
        dev, test = ({needles.random_value(kind, rngs[s], s) for _ in range(draws)} for s in SPLITS)
        assert len(dev) > 0.99 * draws and dev.isdisjoint(test)
    rngs = {split: random.Random(f"names:{split}") for split in SPLITS}
    dev, test = ({needles.random_upper_name(rngs[s], 5, s) for _ in range(draws)} for s in SPLITS)
    assert dev.isdisjoint(test) and all(len(n) == 5 and n.isupper() for n in dev | test)
    numbers = [int(needles.random_number(random.Random(i), "test")) for i in range(2000)]
    assert all(10**6 <= n < 10**7 and n % 2 for n in numbers)
    assert min(numbers) < 1_100_000 and max(numbers) > 9_900_000  # the whole range, odd numbers only
    assert {split_index(random.Random(i), 3, "dev") for i in range(100)} == {0, 2}
    assert {split_index(random.Random(i), 3, "test") for i in range(100)} == {1}


# -------------------------------------------------------------------------------------------- essays


def test_essay_halves_are_disjoint_and_cover_every_essay():
    dev, test, every = essay_files("dev"), essay_files("test"), essay_files()
    assert len(every) >= 48
    assert set(dev).isdisjoint(test) and sorted(dev + test) == sorted(every)
    assert abs(len(dev) - len(test)) <= 1
    assert " ".join(essay_words("dev"))[:500] not in " ".join(essay_words("test"))


def test_calibration_prompts_come_from_the_dev_essays_only(tok):
    from eval.calibrate import essay_prompts

    text = {split: " ".join(essay_words(split)) for split in SPLITS}
    prompts = essay_prompts(tok, 3, 256)
    for window in prompts:
        decoded = tok.decode(window[0, 8:-8]).strip()  # the window's ends may cut a word
        assert len(decoded) > 500
        assert decoded in text["dev"] and decoded not in text["test"]


# ---------------------------------------------------------------------------------------- NIAH, toy


def test_niah_splits_share_no_needle_key_value_or_essay(generated):
    dev, test = (generated[split]["niah"] for split in SPLITS)
    (dev_keys, dev_values), (test_keys, test_values) = _needles(dev), _needles(test)
    assert len(dev_keys) == len(dev) == 3 and len(test_values) == 3
    assert dev_keys.isdisjoint(test_keys) and dev_values.isdisjoint(test_values)
    assert {int(v) % 2 for v in dev_values} == {0} and {int(v) % 2 for v in test_values} == {1}
    text = {split: " ".join(essay_words(split)) for split in SPLITS}
    for split, other in (SPLITS, SPLITS[::-1]):
        for sample in generated[split]["niah"]:
            sentence = _longest_essay_sentence(sample)
            assert sentence in text[split] and sentence not in text[other] and sample["split"] == split


def test_niah_benchmark_passes_its_split(tok):
    benchmark, errors = build_benchmark({"name": "niah", "lengths": [LENGTH], "depths": [50], "split": "dev"})
    assert errors == []
    assert [s["split"] for s in benchmark.load(tok)] == ["dev"]


def test_toy_splits_use_disjoint_keys_values_and_seeds(generated):
    dev, test = (generated[split]["toy"] for split in SPLITS)
    keys = {
        split: {s["question"].split(" for ")[1].rstrip("?") for s in generated[split]["toy"]}
        for split in SPLITS
    }
    assert keys["dev"] <= set(WORDS[0::2]) and keys["test"] <= set(WORDS[1::2])
    assert len(keys["dev"]) > 3 and len(keys["test"]) > 3
    assert {int(s["answers"][0]) % 2 for s in dev} == {0} and {int(s["answers"][0]) % 2 for s in test} == {1}
    assert Toy(split="dev").sample_seed("toy", 256) != Toy(split="test").sample_seed("toy", 256)
    assert Toy(split="dev").load(None) != Toy(split="test").load(None)


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("name", ["ruler", "niah", "toy", "longbench"])
@pytest.mark.parametrize("split", ["train", "Test", None, ["dev"]])
def test_a_bad_split_is_one_validation_line(name, split):
    _, errors = build_benchmark({"name": name, "split": split})
    assert len(errors) == 1 and errors[0].startswith("benchmark.split: must be one of dev, test"), errors


def test_splits_default_to_test_and_longbench_refuses_dev():
    for name in ("ruler", "niah", "toy", "longbench"):
        benchmark, errors = build_benchmark({"name": name})
        assert errors == [] and benchmark.split == "test" and benchmark.params()["split"] == "test"
    for name in ("ruler", "niah", "toy"):
        assert build_benchmark({"name": name, "split": "dev"})[1] == []
    _, errors = build_benchmark({"name": "longbench", "split": "dev"})
    assert len(errors) == 1 and "LongBench is a fixed published test set" in errors[0]


def test_generators_refuse_a_bad_split_with_one_line(tok):
    for generate in (
        lambda: generate_samples("niah_single_1", LENGTH, tok, 1, split="train"),
        lambda: generate_niah([LENGTH], [50], tok, progress=False, split="train"),
    ):
        with pytest.raises(ValueError) as info:
            generate()
        assert "\n" not in str(info.value) and "split" in str(info.value)


def test_cli_split_option(capsys):
    from eval.benchmarks.ruler.__main__ import main as cli_main

    assert cli_main(["--task", "niah_single_1", "--length", str(LENGTH), "--split", "dev"]) == 0
    assert "(dev split, seed 0)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli_main(["--task", "niah_single_1", "--length", str(LENGTH), "--split", "train"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "--split" in err


@pytest.mark.parametrize(
    "experiment, split",
    [("ablate_centroidkv", "dev"), ("ablate_heads", "dev"), ("sweep_r", "dev"), ("reproduce_ruler_cpu", "test"),
     ("reproduce_ruler", "test"), ("kvpress_zoo", "test"), ("heads", "test"), ("heads_low", "test")],
)  # fmt: skip
def test_experiments_choose_on_dev_and_report_on_test(experiment, split):
    config = yaml.safe_load((CONFIGS / f"{experiment}.yaml").read_text())
    assert config["benchmark"]["split"] == split
