"""`python -m eval.results`: one line per job folder, from records written in a temporary folder."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from eval.records import CONFIG, DONE, LOCK, RECORDS
from eval.results import job_folders, main, summarize


def record(variant: str, budget: float, status: str = "ok", score: float | None = 100.0) -> dict:
    return {
        "benchmark": "ruler",
        "task": "niah_single_1",
        "length": 4096,
        "sample_id": f"niah_single_1-4096-{variant}-{budget}",
        "method": variant.split("-")[0],
        "variant": variant,
        "params": {},
        "budget": budget,
        "status": status,
        "score": score if status == "ok" else None,
        "split": "dev",
        "budget_unit": "bytes",
        "model": "smollm2-135m",
    }


def write_job(job_dir: Path, records: list[dict], identity: dict | None = None) -> Path:
    job_dir.mkdir(parents=True)
    (job_dir / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    if identity is not None:
        (job_dir / CONFIG).write_text("identity:\n" + "".join(f"  {k}: {v}\n" for k, v in identity.items()))
    return job_dir


def lock_text(pid: int) -> str:
    return json.dumps({"pid": pid, "host": socket.gethostname(), "since": "2026-01-01 00:00:00"})


def test_lists_each_job_with_its_counts_scores_and_status(tmp_path, capsys):
    done = write_job(
        tmp_path / "exp_a" / "budget=0.25-abc123",
        [record("full", 1.0), record("centroidkv", 0.25, score=50.0), record("snapkv", 0.25, "failed")],
        identity={"model.name": "smollm2-135m", "benchmark.name": "ruler", "benchmark.n_samples": 4},
    )
    (done / DONE).write_text("{}\n")
    (done / "wandb" / "offline-run-20260101_000000-abcd").mkdir(parents=True)
    running = write_job(tmp_path / "exp_b" / "default", [record("centroidkv", 0.5)])
    (running / LOCK).write_text(lock_text(os.getpid()))  # this process: alive
    stopped = write_job(tmp_path / "exp_b" / "old", [record("h2o", 0.5, score=0.0)])
    (stopped / LOCK).write_text(lock_text(2**22 + 12345))  # no such process: a dead run

    assert job_folders(tmp_path) == [done, running, stopped]
    summary = summarize(done)
    assert (summary.n_ok, summary.n_failed) == (2, 1)
    assert summary.mean_scores == {"full": {1.0: 100.0}, "centroidkv": {0.25: 50.0}, "snapkv": {}}
    assert summary.methods == ["full", "centroidkv", "snapkv"] and summary.budgets == [0.25]
    assert summary.parameters == {
        "model": "smollm2-135m",
        "benchmark": "ruler",
        "split": "dev",
        "n_samples": 4,
        "budget_unit": "bytes",
    }
    assert summary.status == "done"
    assert summarize(running).status.startswith(f"running (pid {os.getpid()} on host")
    assert summarize(stopped).status == "stopped"

    assert main([str(tmp_path), "--sync-hint"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["experiment", "job", "methods"]
    by_job = {line.split()[1]: line for line in lines[1:4]}
    assert "full 100.0, centroidkv 50.0@0.25, snapkv -  " in by_job["budget=0.25-abc123"]
    assert by_job["budget=0.25-abc123"].split()[-4:] == ["0.25", "2", "1", "done"]
    assert "running (pid" in by_job["default"] and by_job["old"].endswith("stopped")
    assert lines[-1] == f"wandb sync {done / 'wandb' / 'offline-run-20260101_000000-abcd'}"


def test_one_job_folder_and_errors(tmp_path, capsys):
    job = write_job(tmp_path / "exp" / "job", [record("full", 1.0)])
    assert job_folders(job) == [job]
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main([str(tmp_path / "exp"), "--sync-hint"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no offline W&B runs to sync"


def test_a_job_mixing_the_full_cache_and_two_budgets_shows_each_methods_mean_and_only_real_budgets(
    tmp_path, capsys
):
    """Before: one pooled "score 80.0" for full 100, centroidkv 100 and 100, snapkv 0 and 100, and
    the budgets "0.25,0.5,1" with the full cache's reference run among them; then (issue 40) one
    mean over budgets, "snapkv 50.0", and the full cache listed where its first record came."""
    records = [record("centroidkv", 0.25), record("full", 1.0), record("centroidkv", 0.5)]
    records += [record("snapkv", 0.25, score=0.0), record("snapkv", 0.5)]
    write_job(tmp_path / "ruler_small" / "job", records)
    assert main([str(tmp_path)]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert "score" not in header.replace("methods (mean score)", "")  # no pooled score column
    assert "full 100.0, centroidkv 100.0@0.25 100.0@0.5, snapkv 0.0@0.25 100.0@0.5" in line
    assert line.split()[-4:] == ["0.25,0.5", "5", "0", "stopped"]


def test_the_lister_never_imports_torch_once_the_schema_is_cached(tmp_path):
    """Issue 40, item 6. Before: `python -m eval.results` took 16 s, 10 of them importing torch for
    the registry (which methods compress); now that comes from the cached torch-free schema."""
    import subprocess
    import sys

    write_job(tmp_path / "exp" / "job", [record("full", 1.0), record("snapkv", 0.25, score=0.0)])
    root = Path(__file__).resolve().parent.parent
    warm = "from centroidkv.schema import config_schema; config_schema()"
    subprocess.run([sys.executable, "-c", warm], cwd=root, check=True)
    check = (
        f"import sys; from eval.results import main; main([{str(tmp_path)!r}]); print('torch' in sys.modules)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", check], cwd=root, capture_output=True, text=True, check=True
    )
    assert shown.stdout.splitlines()[-1] == "False" and "full 100.0, snapkv 0.0@0.25" in shown.stdout


def test_the_lister_lists_every_job_of_the_compact_files_before_and_after_make_published(tmp_path, capsys):
    """Issue 54, item 2. Before: after `rm -rf results/*/ && make published`, `python -m eval.results`
    said "no jobs under results": it read job folders only. Now each compact file's jobs are listed,
    `compact (<file>)` until `make published` wrote their tables, then `published (<tables folder>)`; a job
    folder of the same job is listed once, from its own records."""
    from scripts.compact_records import main as compact_main

    root = Path(__file__).resolve().parent.parent / "results"
    for name in ("tiny_example.jsonl.gz", "reproduce_ruler_cpu.jsonl.gz"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [
        ["reproduce_ruler_cpu", "ruler-9methods-0.125+0.25+0.5+0.75-a03441"],
        ["tiny_example", "toy-3methods-0.25+0.5-11e91c"],
    ]
    assert lines[0].endswith("compact (reproduce_ruler_cpu.jsonl.gz)")
    assert lines[1].endswith("compact (tiny_example.jsonl.gz)")
    assert "full 63.0, centroidkv 69.0@0.125 65.0@0.25 62.0@0.5 65.0@0.75" in lines[0]
    assert compact_main(["tables", *map(str, sorted(tmp_path.glob("*.jsonl.gz"))), "--no-figures"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 2 and lines[1].endswith(f"published ({tmp_path / 'tiny_example' / 'tables'})")
    write_job(tmp_path / "tiny_example" / "toy-3methods-0.25+0.5-11e91c", [record("full", 1.0)])
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 2 and lines[1].split()[:3] == [
        "tiny_example",
        "toy-3methods-0.25+0.5-11e91c",
        "full",
    ]
    assert lines[1].endswith("stopped")
