"""A rerun equals its record: the small committed job results/rerun_check.jsonl.gz (the embedded
SmolLM2 on RULER at 1k, every fork of a sample decoded as a row of one batch, H2O's received-attention
prefill among them) runs again through the job's own path (scripts/verify_published.py), and every
field the tables read equals the committed one."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from centroidkv.calibrate import NOT_CALIBRATED
from eval.compact_store import read_compact
from eval.run_config import ConfigError
from scripts.verify_published import (
    differences,
    differing_keys,
    identity_differences,
    job_config,
    main,
    rerun_job,
)

ROOT = Path(__file__).resolve().parent.parent
COMPACT = ROOT / "results" / "rerun_check.jsonl.gz"


@pytest.fixture(scope="module")
def rerun_records() -> list[dict]:
    header, _ = read_compact(COMPACT)
    [(job, identity)] = header["identities"].items()
    with tempfile.TemporaryDirectory() as results_dir:
        config = job_config(job, identity, [], Path(results_dir))
    return rerun_job(config, job, identity, None, None)


def test_the_whole_job_is_rerun_with_centroidkv_batched_among_other_forks(rerun_records):
    _, committed = read_compact(COMPACT)
    assert len(rerun_records) == len(committed) > 0
    batched = [r for r in rerun_records if r["method"] == "centroidkv" and r["decode_batch"] > 1]
    assert batched and all(r["status"] == "ok" for r in rerun_records)


def test_every_rerun_record_equals_its_committed_one(rerun_records):
    _, committed = read_compact(COMPACT)
    assert differences(committed, rerun_records) == []


def test_a_committed_score_edited_by_one_point_is_the_one_line_reported(rerun_records):
    _, committed = read_compact(COMPACT)
    edited = next(r for r in committed if r["method"] == "centroidkv")
    before = edited["score"]
    edited["score"] = before + 1
    [line] = differences(committed, rerun_records)
    assert line.endswith(
        f"{edited['sample_id']} centroidkv@{edited['budget']:g}: score {before + 1!r} -> {before!r}"
    )


def test_a_composed_job_with_other_settings_is_refused_in_one_line_before_any_model_loads(
    no_model_loading, capsys
):
    assert main([str(COMPACT), "--override", "benchmark.max_new_tokens=16"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "is not the committed job: benchmark.max_new_tokens (24 committed, 16 now)" in line


def test_the_identity_check_names_the_overrides_it_composed():
    header, _ = read_compact(COMPACT)
    [(job, identity)] = header["identities"].items()
    with tempfile.TemporaryDirectory() as results_dir, pytest.raises(ConfigError) as refused:
        job_config(job, {**identity, "decode_batch": 1}, [], Path(results_dir))
    assert refused.value.lines[0].startswith(f"{job}: experiment=rerun_check model=smollm2-135m is not")


HEADS_KEY = "methods.centroidkv-whole.heads_file_read"
CALIBRATED = "<cache>/outlier_heads/qwen2.5-0.5b.json sha256:bdd0e8e0a40a"


def said_of(committed: dict, found: dict, uncalibrated_ok: bool) -> str:
    return identity_differences(committed, found, differing_keys(committed, found, uncalibrated_ok))


def test_a_head_file_this_machine_has_not_calibrated_waits_for_the_rerun_to_calibrate_it():
    missing = {HEADS_KEY: f"<cache>/outlier_heads/qwen2.5-0.5b.json {NOT_CALIBRATED}"}
    assert said_of({HEADS_KEY: CALIBRATED}, missing, uncalibrated_ok=True) == ""
    # once calibrated (after the model loads) the file must be the committed one
    said = said_of({HEADS_KEY: CALIBRATED}, missing, uncalibrated_ok=False)
    assert said.startswith(HEADS_KEY)


def test_a_head_file_with_another_hash_is_named_with_both_hashes():
    other = {HEADS_KEY: CALIBRATED.replace("bdd0e8e0a40a", "0123456789ab")}
    said = said_of({HEADS_KEY: CALIBRATED}, other, uncalibrated_ok=True)
    assert "bdd0e8e0a40a" in said and "0123456789ab" in said


def test_a_head_file_hashed_otherwise_is_refused_unless_any_head_scores_is_asked(no_model_loading):
    header, _ = read_compact(COMPACT)
    [(job, identity)] = header["identities"].items()
    key = "methods.centroidkv.heads_file_read"
    other_cpu = {**identity, key: identity[key][:-12] + "0123456789ab"}
    with tempfile.TemporaryDirectory() as results_dir:
        with pytest.raises(ConfigError) as refused:
            job_config(job, other_cpu, [], Path(results_dir))
        assert "0123456789ab" in refused.value.lines[0]
        assert job_config(job, other_cpu, [], Path(results_dir), any_head_scores=True).identity() == identity
