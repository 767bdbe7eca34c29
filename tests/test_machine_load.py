"""Issue 40, item 5: timings carry the machine's load. Before: TTFT differed 2x between methods of
one multirun table because of the machine's load, and nothing said so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eval.machine_load import load_note, machine_load

ROOT = Path(__file__).resolve().parent.parent


def test_the_note_gives_the_load_and_warns_when_it_exceeded_the_cores():
    assert load_note([{"ttft": 0.1}]) == ""
    calm = load_note([{"load_1min": 0.5, "n_cores": 2}, {"load_1min": 1.5, "n_cores": 2}])
    assert "up to 1.5 on 2 cores" in calm and "Warning" not in calm
    busy = load_note([{"load_1min": 3.7, "n_cores": 2}, {"load_1min": 0.2, "n_cores": 2}])
    assert "up to 3.7 on 2 cores" in busy and "Warning: the load exceeded the cores" in busy


def test_every_record_of_a_job_carries_the_load_and_the_cores(tmp_path):
    assert machine_load()["n_cores"] == os.cpu_count()
    overrides = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false", "methods=[full,snapkv]",
                 "budgets=[0.5]", "benchmark.n_samples=1", f"results_dir={tmp_path}"]  # fmt: skip
    subprocess.run([sys.executable, "scripts/run.py", *overrides], cwd=ROOT, check=True, capture_output=True)
    (records_file,) = tmp_path.rglob("records.jsonl")
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert records and all(
        isinstance(r["load_1min"], float) and r["n_cores"] == os.cpu_count() for r in records
    )
