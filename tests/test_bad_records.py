"""Records that cannot be trusted: a field of the wrong type is dropped and kept aside, records
copied from another job are refused on resume and skipped by the tables (issue 29, D2, D3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_harness import run_cfg

from eval.records import JobMismatch
from eval.runner import config_yaml_of, run_job
from scripts.reports import tables

pytestmark = pytest.mark.usefixtures("one_thread")


TWO_METHODS = [
    "methods=[full,snapkv]",
    "budgets=[0.5]",
    "benchmark.n_samples=2",
    "benchmark.max_new_tokens=2",
]


def finished_job(tmp_path: Path, overrides: list[str] = TWO_METHODS):
    """A finished tiny job: (its config, the composed Hydra config, its records.jsonl)."""
    cfg, raw = run_cfg(tmp_path, overrides)
    run_job(cfg, config_yaml_of(cfg, raw))
    return cfg, raw, cfg.job_dir / "records.jsonl"


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def toy_records(experiment: str, benchmark: str = "toy") -> list[dict[str, Any]]:
    """Full cache and SnapKV at 0.5 on two samples, naming `experiment` and `benchmark` themselves."""
    return [
        {
            "benchmark": benchmark,
            "task": "toy",
            "length": 256,
            "sample_id": f"toy-{i}",
            "method": method,
            "variant": method,
            "params": {},
            "budget": budget,
            "status": "ok",
            "score": score,
            "model": "tiny-llama",
            "experiment": experiment,
        }  # fmt: skip
        for i in range(2)
        for method, budget, score in (("full", 1.0, 100.0), ("snapkv", 0.5, 50.0))
    ]


def write_job(folder: Path, records: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder.parent


# ------------------------------------------------------------ D2. a record field of the wrong type
def test_records_with_a_wrong_type_are_dropped_kept_aside_and_the_job_finishes(tmp_path):
    """Before: resume crashed in summarize (ValueError: Unknown format code 'g' / TypeError), exit 1,
    and done.json was never written, so every rerun crashed again."""
    cfg, raw, path = finished_job(tmp_path)
    good = path.read_text()
    first = json.loads(good.splitlines()[0])
    bad = [{**first, "sample_id": "x1", "budget": "abc"}, {**first, "sample_id": "x2", "score": "high"}]
    bad_lines = "".join(json.dumps(r) + "\n" for r in bad)
    path.write_text(good + bad_lines)
    (cfg.job_dir / "done.json").unlink()
    summary = run_job(cfg, config_yaml_of(cfg, raw))
    assert summary["n_records"] == 4 and summary["n_dropped_lines"] == 2 and summary["n_failed"] == 0
    assert path.read_text() == good and (cfg.job_dir / "done.json").is_file()
    (kept,) = cfg.job_dir.glob("records.jsonl.dropped-*")
    assert kept.read_text() == bad_lines  # nothing written is lost


# ------------------------------------------------------------------ D3. records of another job
def test_records_copied_from_another_job_are_refused_on_resume_and_skipped_by_tables(tmp_path, capsys):
    """Before: a record of smollm2-135m / someone-elses-job replaced a genuine one on resume, and the
    tables pooled it (SnapKV 0.0 -> 50.0 here, caption "smollm2-135m, tiny-llama")."""
    cfg, raw, path = finished_job(tmp_path)
    genuine = [r for r in map(json.loads, path.read_text().splitlines()) if r["method"] == "snapkv"]
    foreign = {**genuine[0], "model": "smollm2-135m", "job": "someone-elses-job", "score": 100.0}
    with path.open("a") as handle:
        handle.write(json.dumps(foreign) + "\n")
    before = path.read_text()
    (cfg.job_dir / "done.json").unlink()
    with pytest.raises(JobMismatch) as error:
        run_job(cfg, config_yaml_of(cfg, raw))
    assert str(error.value) == (
        f"{path} holds 1 record(s) of another job (model smollm2-135m, job someone-elses-job); move them "
        "out of the file, or pass overwrite=true (--force) to start the job again"
    )
    assert error.value.exit_code == 2 and path.read_text() == before
    df = tables.load([cfg.job_dir.parent])
    assert set(df["model"]) == {"tiny-llama"} and len(df) == 4
    assert sorted(df.loc[df["method"] == "snapkv", "score"]) == sorted(r["score"] for r in genuine)
    assert (
        "1 record(s) of another job skipped (model smollm2-135m, job someone-elses-job)"
        in capsys.readouterr().err
    )
