"""Ctrl-C is one line and keeps what was written: during a job (which then resumes) and during a
calibration (issue 29, D11; issue 39, D9)."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from test_job_safety import RUN, TINY, env, wait_for_records
from test_refused_before_loading import one_error_line

import centroidkv.models.loading
from eval import calibrate as eval_calibrate
from eval.records import read_records
from eval.runner import config_yaml_of, run_job

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- D11. Ctrl-C during a job
N_SAMPLES = 300


def _default_sigint() -> None:
    """In the job's process: Ctrl-C's default handling, even when this test runs in the background,
    where the shell starts it with SIGINT ignored (and Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_the_job_resumes(tmp_path):
    """Before: a KeyboardInterrupt traceback. Now one line with the records kept, exit 130, and the
    rerun completes the job from them."""
    from eval.sweep import plan

    results = tmp_path / "results"
    # enough samples that the job (~50 samples/s on a tiny model) cannot end before the interrupt
    args = [*TINY, f"results_dir={results}", "methods=[full,streaming_llm]", "budgets=[0.5]",
            f"benchmark.n_samples={N_SAMPLES}", "benchmark.max_new_tokens=6"]  # fmt: skip
    job = subprocess.Popen(
        [*RUN, *args],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        records_path = wait_for_records(results, "*/*/records.jsonl", 4, job)
    finally:
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip() and "sample/s" not in line]
    kept = read_records(records_path)[0]
    assert job.returncode == 130, err[-3000:]
    assert lines == [
        f"error: {records_path.parent}: interrupted after {len(kept)} record(s), all kept in records.jsonl; "
        "rerun the same command to resume"
    ]
    (cfg,) = plan(args)  # the same job, resumed in this process
    assert cfg.job_dir == records_path.parent
    assert run_job(cfg, config_yaml_of(cfg, None))["n_records"] == 2 * N_SAMPLES
    after = {json.dumps(r, sort_keys=True) for r in read_records(records_path)[0]}
    assert len(after) == 2 * N_SAMPLES and {json.dumps(r, sort_keys=True) for r in kept} <= after


# ------------------------------------------------------------------ D9. Ctrl-C during calibration
def test_ctrl_c_during_calibration_is_one_line(tmp_path, monkeypatch, capsys):
    """Before: a KeyboardInterrupt traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(centroidkv.models.loading, "load_model", interrupted)
    assert eval_calibrate.cli(["--prompts", "1", "--tokens", "512", "--out", str(tmp_path / "x.json")]) == 130
    assert one_error_line(capsys) == "calibrate: interrupted; nothing written"
    assert list(tmp_path.iterdir()) == []
