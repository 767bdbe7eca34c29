"""Issue 40, item 4: the same sample x method x budget x configuration from two jobs is counted once.
Before: two jobs over the same 3 samples gave the full cache n = 6 in tables.py, "3-6 samples per
task" in the figure and 3 in the ranking beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.reports import tables


def record(job: str, method: str, budget: float, sample: int, score: float, **params: Any) -> dict[str, Any]:
    return {"benchmark": "ruler", "task": "vt", "length": 1024, "sample_id": f"vt-{sample}", "method": method,
            "variant": method, "params": params, "budget": budget, "status": "ok", "score": score,
            "model": "smollm2-135m", "experiment": "exp", "job": job, "kv_budget_ratio": budget}  # fmt: skip


def write_job(root: Path, job: str, records: list[dict[str, Any]]) -> None:
    folder = root / "exp" / job
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_two_jobs_over_the_same_samples_count_each_sample_once(tmp_path, capsys):
    for job in ("first", "second"):
        write_job(tmp_path, job, [record(job, "full", 1.0, i, 100.0) for i in range(3)])
    frame = tables.load([tmp_path])
    assert len(frame) == 3 and set(frame["job"]) == {"first"}
    warning = capsys.readouterr().err.strip().splitlines()
    assert warning == [
        "[records] exp/second: 3 record(s) repeat exp/first's (same sample, method, budget and "
        "configuration): counted once"
    ]


def test_another_configuration_or_budget_of_the_same_sample_is_kept(tmp_path):
    write_job(tmp_path, "a", [record("a", "snapkv", 0.5, 0, 1.0, window_size=16)])
    write_job(tmp_path, "b", [record("b", "snapkv", 0.5, 0, 1.0, window_size=32)])
    write_job(tmp_path, "c", [record("c", "snapkv", 0.25, 0, 1.0, window_size=16)])
    assert len(tables.load([tmp_path])) == 3


def test_a_comparison_without_the_full_cache_says_it_has_no_reference(tmp_path):
    """Issue 40, item 5: a multirun over methods and budgets had no full-cache row, silently."""
    write_job(tmp_path, "a", [record("a", "snapkv", 0.5, i, 1.0) for i in range(2)])
    caption = tables.make_tables(tables.load([tmp_path]))["ruler_budget0.5"][0]
    assert caption.endswith(tables.MISSING_REFERENCE.removeprefix(". "))
    write_job(tmp_path, "b", [record("b", "full", 1.0, i, 1.0) for i in range(2)])
    assert "full-cache reference" not in tables.make_tables(tables.load([tmp_path]))["ruler_budget0.5"][0]
