"""Sweeps through Hydra's launcher plugins: the jobs of one sweep run in parallel processes, each in
its own job folder, and the sweep's records and tables equal a serial run's.

submitit's local executor runs the same plugin and code path as SLURM (`hydra/launcher=slurm`); Ray
runs on a local instance (`hydra/launcher=ray_local`). Each test is skipped when its plugin is not
installed (`pip install -e ".[slurm]"` / `".[ray]"`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.records import read_records

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ["model=tiny-llama", "benchmark=ruler", "benchmark.tasks=[niah_single_1]", "benchmark.lengths=[1024]",
         "benchmark.n_samples=1", "benchmark.max_new_tokens=4", "methods=[full,centroidkv]",
         "method.budget=0.25,0.5", "logger=none", "warmup=false", "experiment_name=sweep"]  # fmt: skip
TIMING = ("ttft", "tpot", "prefill_s", "compress_s", "feed_s", "decode_s", "peak_mem")


def sweep(results: Path, *launcher: str) -> dict[str, list[dict]]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run.py"), "-m", *launcher, *SWEEP, f"results_dir={results}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = {}
    for path in sorted((results / "sweep").glob("*/records.jsonl")):
        records, _ = read_records(path)
        jobs[path.parent.name] = [{k: v for k, v in r.items() if k not in TIMING} for r in records]
        assert (path.parent / "done.json").exists()
    return jobs


def tables(results: Path, out: Path) -> dict[str, str]:
    from scripts.tables import main

    assert main([str(results / "sweep"), "--out", str(out)]) == 0
    return {p.name: p.read_text() for p in sorted(out.glob("ruler_*"))}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    results = tmp_path_factory.mktemp("serial")
    return sweep(results), tables(results, results / "tables")


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')")  # fmt: skip
def test_submitit_local_sweep_equals_the_serial_one(tmp_path, serial):
    serial_jobs, serial_tables = serial
    jobs = sweep(tmp_path, "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'hydra'}")
    assert len(jobs) == 2 and jobs == serial_jobs  # two job folders, the same records
    assert tables(tmp_path, tmp_path / "tables") == serial_tables and serial_tables
    assert len(list((tmp_path / "hydra" / ".submitit").glob("*/*_log.out"))) == 2  # two submitit jobs


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="hydra-ray-launcher is not installed (pip install -e '.[ray]')")  # fmt: skip
def test_ray_local_sweep_equals_the_serial_one(tmp_path, serial):
    serial_jobs, serial_tables = serial
    jobs = sweep(tmp_path, "hydra/launcher=ray_local", "+hydra.launcher.ray.init.num_cpus=2")
    assert len(jobs) == 2 and jobs == serial_jobs
    assert tables(tmp_path, tmp_path / "tables") == serial_tables and serial_tables


def test_each_job_of_a_sweep_writes_its_own_folder(serial):
    serial_jobs, _ = serial
    budgets = {
        job: {r["budget"] for r in records if r["method"] != "full"} for job, records in serial_jobs.items()
    }
    assert sorted(map(sorted, budgets.values())) == [[0.25], [0.5]]
    for records in serial_jobs.values():
        assert sorted((r["method"], r["status"]) for r in records) == [("centroidkv", "ok"), ("full", "ok")]
