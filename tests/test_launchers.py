"""Sweeps through Hydra's launcher plugins: the jobs of one sweep run in parallel processes, each in
its own job folder, and the sweep's records and tables equal a serial run's.

submitit's local executor runs the same plugin and code path as SLURM (`hydra/launcher=slurm`); Ray
runs on a local instance (`hydra/launcher=ray_local`). Each test is skipped when its plugin is not
installed (`pip install -e ".[slurm]"` / `".[ray]"`). A job whose folder another run takes while the
sweep launches is one line of the sweep, and no process of the sweep outlives it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from eval.job_store import JobStore
from eval.records import read_records, scan_records

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ["model=tiny-llama", "benchmark=ruler", "benchmark.tasks=[niah_single_1]", "benchmark.lengths=[1024]",
         "benchmark.n_samples=1", "benchmark.max_new_tokens=4", "methods=[full,centroidkv]",
         "method.budget=0.25,0.5", "logger=none", "warmup=false", "experiment_name=sweep"]  # fmt: skip
# what depends on the moment a record is made: timings and the machine load they were measured under
TIMING = ("ttft", "tpot", "prefill_s", "compress_s", "feed_s", "decode_s", "peak_mem", "load_1min", "n_cores")


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
    from scripts.reports.tables import main

    assert main([str(results / "sweep"), "--out", str(out)]) == 0
    return {p.name: p.read_text() for p in sorted(out.glob("ruler_*"))}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    results = tmp_path_factory.mktemp("serial")
    return sweep(results), tables(results, results / "tables")


needs_submitit = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')",
)


@needs_submitit
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


def processes_of_group(group: int) -> list[str]:
    """The command lines of the live (not zombie) processes of a process group."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(" ".join(process.cmdline()))
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


@needs_submitit
def test_a_job_locked_while_the_sweep_launches_is_one_line_and_no_job_outlives_the_sweep(tmp_path):
    """The sweep checks every job folder before it launches; here another run takes job 0's folder
    after that check, before the job starts (a barrier in submitit's `setup` holds both jobs until the
    lock is taken). Before: exit 1 with a 30-line UncompletedJobError, and job 1 kept running, an
    orphan. Now: one line naming the folder and its holder, exit 2, and job 1 finishes normally (done,
    every record whole) before the sweep exits, which leaves no process behind."""
    from test_hardening import job_dirs
    from test_job_safety import RUN, TINY, env

    gate = tmp_path / "gate"
    gate.mkdir()
    n_sibling = 30  # samples of job 1: it still runs when job 0 stops (seconds, even on a busy machine)
    args = ["-m", *TINY, "method=full", f"benchmark.n_samples=1,{n_sibling}", "benchmark.max_new_tokens=2",
            f"results_dir={tmp_path / 'results'}"]  # fmt: skip
    locked, sibling = job_dirs(args)
    barrier = f"touch {gate}/started-$$; while [ ! -e {gate}/go ]; do sleep 0.05; done"
    sweep = subprocess.Popen(
        [*RUN, *args, "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'hydra'}",
         f'+hydra.launcher.setup=["{barrier}"]'],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(),
        start_new_session=True,  # its own process group: every process it starts is in it
    )  # fmt: skip
    store = JobStore(locked)
    try:
        deadline = time.time() + 600
        while len(list(gate.glob("started-*"))) < 2:  # both jobs launched, neither started
            assert sweep.poll() is None, sweep.stderr.read()[-3000:]
            assert time.time() < deadline, "the sweep launched no job in 10 minutes"
            time.sleep(0.05)
        store.lock()
        (gate / "go").touch()
        _, stderr = sweep.communicate(timeout=600)
        left = processes_of_group(sweep.pid)
    finally:
        store.unlock()
        sweep.kill()
        try:
            os.killpg(sweep.pid, signal.SIGKILL)  # clean up after a failure: an orphan would still run
        except ProcessLookupError:
            pass
    assert sweep.returncode == 2, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith(
        f"error: {locked} is being run by pid {os.getpid()} on host {socket.gethostname()} "
    )
    assert line.endswith("; wait for it or stop it")
    assert left == []
    assert not (locked / "records.jsonl").exists()  # the locked job wrote nothing
    found = scan_records(sibling / "records.jsonl")
    assert (sibling / "done.json").exists() and len(found.records) == n_sibling and found.n_dropped == 0


@needs_submitit
def test_the_launchers_eval_sweep_names_are_the_plugins_sweepjobs_classes():
    """eval.sweep names our launchers by their Hydra `_target_` (it does not import the plugin module,
    which imports it: no circle); each name is a launcher of the plugin module, with SweepJobs.
    Classes are compared by name: Hydra's plugin scan in an earlier test may import a module anew."""
    import importlib

    from eval.sweep import SWEEP_LAUNCHERS, SWEEP_LAUNCHERS_MODULE

    module = importlib.import_module(SWEEP_LAUNCHERS_MODULE)
    plugin = "hydra_plugins.hydra_submitit_launcher.submitit_launcher"
    expected = {"submitit_local": f"{plugin}.LocalLauncher", "submitit_slurm": f"{plugin}.SlurmLauncher"}
    for name, class_name in SWEEP_LAUNCHERS.items():
        bases = {f"{base.__module__}.{base.__qualname__}" for base in getattr(module, class_name).__mro__}
        assert {"eval.sweep.SweepJobs", expected[name]} <= bases, name
