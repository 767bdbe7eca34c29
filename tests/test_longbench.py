"""LongBench loading from a local fixture (LongBench's jsonl format), truncation, chat rule, hub failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.benchmarks.longbench import data as lb_data
from eval.benchmarks.longbench.constants import E_DATASETS, EN_DATASETS, MAX_NEW_TOKENS, PROMPTS
from eval.benchmarks.longbench.data import load_samples
from eval.benchmarks.longbench.scoring import longbench_e_scores, longbench_score
from eval.common import read_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "longbench"
FIXTURE_DATASETS = sorted(p.stem for p in FIXTURE.glob("*.jsonl") if not p.stem.endswith("_e"))


@pytest.fixture(scope="module")
def tok():
    from centroidkv.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_constants_cover_the_benchmark():
    assert len(EN_DATASETS) == 16 and len(E_DATASETS) == 13 and set(E_DATASETS) <= set(EN_DATASETS)
    assert all("{context}" in PROMPTS[d] for d in EN_DATASETS)
    assert {
        d: MAX_NEW_TOKENS[d] for d in ("narrativeqa", "gov_report", "trec", "samsum", "lcc", "passage_count")
    } == {
        "narrativeqa": 128,
        "gov_report": 512,
        "trec": 64,
        "samsum": 128,
        "lcc": 64,
        "passage_count": 32,
    }


@pytest.mark.parametrize("dataset", FIXTURE_DATASETS)
def test_fixture_samples_offline(dataset, tok):
    rows = read_jsonl(FIXTURE / f"{dataset}.jsonl")
    samples = load_samples(dataset, tok, data_dir=FIXTURE, max_length=4000)
    assert len(samples) == len(rows) >= 1
    for row, s in zip(rows, samples, strict=True):
        assert s["input"] == PROMPTS[dataset].format(context=row["context"], input=row["input"])
        assert s["input"] == s["context"] + s["question"] and row["context"] in s["context"]
        assert s["answers"] == row["answers"] and s["all_classes"] == row["all_classes"]
        assert s["length"] == row["length"] and s["dataset"] == dataset == s["task"]
        assert s["max_new_tokens"] == MAX_NEW_TOKENS[dataset] and s["answer_prefix"] == ""
        assert s["use_chat_template"] == (
            dataset not in {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
        )
        assert not s["truncated"] and s["input_tokens"] > 0


def test_question_part_is_what_follows_the_context(tok):
    s = load_samples("hotpotqa", tok, data_dir=FIXTURE)[0]
    assert s["question"] == (
        "\n\nAnswer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nQuestion: Who designed the dam that filled Marrow Lake?\nAnswer:"
    )
    trec = load_samples("trec", tok, data_dir=FIXTURE)[0]
    assert trec["question"] == "\nQuestion: What is the capital of Peru?\nType:"


def test_middle_truncation_keeps_both_ends(tok):
    full = load_samples("hotpotqa", tok, data_dir=FIXTURE, n=1)[0]
    cut = load_samples("hotpotqa", tok, data_dir=FIXTURE, n=1, max_length=100)[0]
    assert cut["truncated"] and len(cut["input"]) < len(full["input"])
    ids = tok(full["input"])["input_ids"]
    head = tok.decode(ids[:50], skip_special_tokens=True)
    tail = tok.decode(ids[-50:], skip_special_tokens=True)
    assert cut["input"] == head + tail
    assert cut["input"].startswith("Answer the question based on the given passages.")
    assert cut["input"].endswith("Answer:") and cut["question"] and cut["input"].endswith(cut["question"])
    assert abs(cut["input_tokens"] - 100) <= 3


def test_n_limits_and_longbench_e(tok):
    assert len(load_samples("hotpotqa", tok, data_dir=FIXTURE, n=1)) == 1
    e = load_samples("hotpotqa", tok, data_dir=FIXTURE, e=True)
    assert [s["task"] for s in e] == ["hotpotqa_e"] * 3 and [s["length"] for s in e] == [1200, 5400, 9100]
    buckets = longbench_e_scores(
        "hotpotqa_e", ["Ada Quill", "in 1931", "a lake"], [s["answers"] for s in e], [s["length"] for s in e]
    )
    assert buckets == {"0-4k": 100.0, "4-8k": 100.0, "8k+": 0.0}
    with pytest.raises(ValueError):
        load_samples("narrativeqa", tok, data_dir=FIXTURE, e=True)  # not in LongBench-E
    with pytest.raises(ValueError):
        load_samples("nq", tok, data_dir=FIXTURE)
    with pytest.raises(FileNotFoundError):
        load_samples("qasper", tok, data_dir=FIXTURE)


def test_fixture_scores_with_reference_metrics(tok):
    trec = load_samples("trec", tok, data_dir=FIXTURE)
    assert longbench_score("trec", " City\nCountry", trec[0]["answers"], trec[0]["all_classes"]) == 100.0
    # "person" is not a class here; "Individual" also found -> 1/2
    assert (
        longbench_score(
            "trec", "Individual, Description of a person", trec[1]["answers"], trec[1]["all_classes"]
        )
        == 50.0
    )
    lcc = load_samples("lcc", tok, data_dir=FIXTURE)[0]
    assert longbench_score("lcc", "```\n    return total / len(values)\n```", lcc["answers"]) == 100.0
    count = load_samples("passage_count", tok, data_dir=FIXTURE)[0]
    assert longbench_score("passage_count", "3", count["answers"]) == 100.0


def test_hub_failure_is_one_clear_line(monkeypatch):
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection.")

    lb_data._hub_zip.cache_clear()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(RuntimeError) as info:
        load_samples("narrativeqa", "not-even-a-tokenizer")
    message = str(info.value)
    assert "\n" not in message and "THUDM/LongBench" in message and "data_dir=" in message


def test_hub_offline_fails_fast_in_a_fresh_process():
    code = "from eval.benchmarks.longbench.data import load_samples; load_samples('qasper', 'smollm2-135m', e=True)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("RuntimeError: LongBench data needs the Hugging Face Hub dataset 'THUDM/LongBench'")
    )
