"""A wrong answer on a multikey task is classified as another needle's value (a distractor), a value
absent from the prompt's needles, or no value; records of those tasks carry the kind."""

from __future__ import annotations

import pytest

from centroidkv import load_model, load_tokenizer
from eval.benchmarks.ruler import Ruler
from eval.benchmarks.ruler.confusion import confusable, needle_values, wrong_answer_kind
from eval.benchmarks.ruler.tasks import generate_samples
from eval.evaluate import Evaluator
from eval.run_config import MethodSpec

UUID = "01234567-89ab-cdef-0123-456789abcdef"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("task", ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"])
def test_each_kind_of_wrong_answer_is_told_apart(task, tokenizer):
    sample = generate_samples(task, 1024, tokenizer, 1, seed=0, split="dev")[0]
    answer = sample["answers"][0]
    others = sorted(needle_values(sample["context"]) - {answer.lower()})
    assert others, "a multikey prompt holds other needles"
    absent = UUID if task == "niah_multikey_3" else "1234567"
    assert absent not in needle_values(sample["context"])
    kinds = {
        f"It is {others[0]}.": "distractor",
        f"{absent}": "absent",
        "The special magic value is not given.": "no_value",
        "": "no_value",
    }
    for prediction, kind in kinds.items():
        assert wrong_answer_kind(task, prediction, sample["answers"], sample["context"]) == kind, prediction


def test_only_multikey_records_carry_the_kind_and_only_when_wrong(tokenizer):
    ruler = Ruler(tasks=("niah_single_2", "niah_multikey_2"), lengths=(1024,), n_samples=1, split="dev")
    single, multikey = ruler.samples(tokenizer)
    assert not confusable(single["task"]) and confusable(multikey["task"])
    assert ruler.record_fields(single, "nothing", 0.0) == {}
    right = multikey["answers"][0]
    assert ruler.record_fields(multikey, right, ruler.score(multikey, right)) == {"wrong_answer": None}
    other = sorted(needle_values(multikey["context"]) - {right})[0]
    assert ruler.record_fields(multikey, other, ruler.score(multikey, other)) == {
        "wrong_answer": "distractor"
    }


def test_the_evaluator_writes_the_kind_into_records(tokenizer):
    model = load_model("tiny-llama")[0]  # random weights: its answers are wrong, of some kind
    ruler = Ruler(tasks=("niah_multikey_1",), lengths=(1024,), n_samples=1, split="dev", max_new_tokens=4)
    evaluator = Evaluator(model, tokenizer, (MethodSpec("full", 1.0),), ruler)
    (record,) = evaluator.run_sample(ruler.samples(tokenizer)[0], list(evaluator.specs), 4)
    assert record["status"] == "ok" and record["score"] == 0.0
    assert record["wrong_answer"] in ("distractor", "absent", "no_value")


def test_the_table_counts_each_kind_per_method_length_and_budget():
    import sys

    import pandas as pd

    sys.path.insert(0, "scripts")
    from wrong_answers import wrong_answer_counts

    rows = [
        ("centroidkv", 8192, 0.125, "niah_multikey_2", "distractor"),
        ("centroidkv", 8192, 0.125, "niah_multikey_2", None),
        ("centroidkv", 8192, 0.125, "niah_multikey_1", "absent"),
        ("centroidkv", 8192, 0.125, "niah_single_2", None),  # not a multikey task: not counted
        ("snapkv", 8192, 0.125, "niah_multikey_2", "no_value"),
        ("snapkv", 16384, 0.125, "niah_multikey_2", None),  # every answer right: still its samples
        ("centroidkv", 16384, 0.125, "niah_multikey_2", "distractor"),
    ]
    df = pd.DataFrame(rows, columns=["label", "length", "budget", "task", "wrong_answer"]).assign(ok=True)
    counts = wrong_answer_counts(df).set_index(["label", "length"])
    assert counts.loc[("centroidkv", 8192)][["samples", "wrong", "distractor", "absent", "no_value"]].tolist() == [
        3, 2, 1, 1, 0
    ]  # fmt: skip
    assert counts.loc[("snapkv", 8192), "no_value"] == 1
    assert counts.loc[("centroidkv", 16384), "distractor"] == 1
    assert counts.loc[("snapkv", 16384)][["samples", "wrong"]].tolist() == [1, 0]
