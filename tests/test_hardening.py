"""Hardening (issue 19): nothing outside results_dir is touched, a bad file or parameter is one line
before the model loads.

Subprocess tests run scripts/run.py on `tiny-llama` with the `toy` benchmark (as tests/test_job_safety.py
does); the others call the harness in-process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
from test_harness import config_error_line, run_cfg
from test_job_safety import ROOT, RUN, TINY, env, error_lines

from eval.job_store import JobStore
from eval.records import ResultsFolderError, ResultsWriteError, check_results_folder
from eval.run_config import ConfigError

ONE_JOB = [*TINY, "method=full", "benchmark.n_samples=1", "benchmark.max_new_tokens=2"]


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *args], capture_output=True, text=True, env=env(), timeout=timeout)


def job_dirs(args: list[str]) -> list[Path]:
    """The job folders a command line would write, as scripts/run.py plans them."""
    from eval.sweep import plan

    return [cfg.job_dir for cfg in plan(args)]


def outside_file(tmp_path: Path) -> Path:
    """A file outside the results folder, which no run may change."""
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path


# ------------------------------------------------------------------------------ 1. symbolic links
@pytest.mark.parametrize("name", [".lock", "records.jsonl"])
def test_a_linked_lock_or_records_file_is_one_line_and_the_outside_file_is_untouched(tmp_path, name):
    args = [*ONE_JOB, f"results_dir={tmp_path / 'results'}"]
    (job_dir,) = job_dirs(args)
    job_dir.mkdir(parents=True)
    target = outside_file(tmp_path)
    (job_dir / name).symlink_to(target)
    out = run(args, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = error_lines(out)
    assert line == (
        f"config error: {job_dir / name} is a symbolic link: the runner never writes through links; remove it"
    )
    assert target.read_text() == "precious\n"
    assert sorted(p.name for p in job_dir.iterdir()) == [name]  # nothing else written


@pytest.mark.parametrize(
    "linked",
    [
        "config.yaml",
        "env.json",
        "done.json",
        "records.jsonl.replaced-20250101-000000",
        "<job>",
        "<experiment>",
    ],
)
def test_any_link_in_or_above_the_job_folder_is_refused_before_any_work(tmp_path, linked):
    job_dir = tmp_path / "results" / "experiment" / "job"
    target = outside_file(tmp_path)
    if linked == "<experiment>":
        job_dir.parent.parent.mkdir()
        job_dir.parent.symlink_to(target.parent, target_is_directory=True)
        link = job_dir.parent
    elif linked == "<job>":
        job_dir.parent.mkdir(parents=True)
        job_dir.symlink_to(target.parent, target_is_directory=True)
        link = job_dir
    else:
        job_dir.mkdir(parents=True)
        link = job_dir / linked
        link.symlink_to(target)
    with pytest.raises(ResultsFolderError, match="is a symbolic link") as error:
        check_results_folder(job_dir)
    assert str(error.value).startswith(f"{link} is a symbolic link") and error.value.exit_code == 2
    assert sorted(target.parent.iterdir()) == [target] and target.read_text() == "precious\n"


def test_the_lock_and_records_are_opened_without_following_a_link(tmp_path):
    """A link made after the folder was checked (a race) is still never written through."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    target = outside_file(tmp_path)
    (job_dir / ".lock").symlink_to(target)
    (job_dir / "records.jsonl").symlink_to(target)
    store = JobStore(job_dir)
    with pytest.raises(
        ResultsFolderError, match="it is a symbolic link, which the runner never writes through"
    ):
        store.lock()
    with pytest.raises(
        ResultsWriteError, match="it is a symbolic link, which the runner never writes through"
    ):
        store.append({"benchmark": "toy", "sample_id": "a", "method": "full", "budget": 1.0, "status": "ok"})
    assert target.read_text() == "precious\n"


# ---------------------------------------------------------------------------- 2. path traversal
@pytest.mark.parametrize("name", ["..", ".", "a/b", "../escape"])
def test_an_experiment_name_that_leaves_the_results_folder_is_one_line(tmp_path, name):
    line = config_error_line(tmp_path, [f"experiment_name={name}"])
    assert line == (
        f"experiment_name: must be a plain folder name (letters, digits, _ . -; not . or ..), got {name!r}"
    )


def test_experiment_name_dot_dot_exits_2_and_writes_nothing(tmp_path):
    results = tmp_path / "inner" / "results"
    out = run([*ONE_JOB, f"results_dir={results}", "experiment_name=.."], timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = error_lines(out)
    assert line.startswith("config error: experiment_name: must be a plain folder name")
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- 3. valid JSON, not a record
def test_a_json_line_that_is_not_a_record_is_dropped_and_counted(tmp_path):
    from eval.runner import config_yaml_of, run_job

    cfg, raw = run_cfg(tmp_path, ["method=full", "benchmark.n_samples=2", "benchmark.max_new_tokens=2"])
    run_job(cfg, config_yaml_of(cfg, raw))
    path = cfg.job_dir / "records.jsonl"
    good = path.read_text()
    path.write_text(good + '{"a": 1}\n[1, 2]\n3\n{"status": "ok"}\n')
    (cfg.job_dir / "done.json").unlink()
    summary = run_job(cfg, config_yaml_of(cfg, raw))
    assert summary["n_dropped_lines"] == 4 and summary["n_records"] == 2 and summary["n_failed"] == 0
    assert path.read_text() == good  # cleaned, nothing redone


# --------------------------------------------------------------------------- 9. kvpress parameters
@pytest.mark.skipif(importlib.util.find_spec("kvpress") is None, reason="kvpress is not installed")
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["+method.params.press_params.window_size=abc"],
            "method kvpress: kvpress SnapKVPress: window_size must be int, got 'abc'",
        ),
        (
            ["+method.params.press_params.window_size=true"],
            "method kvpress: kvpress SnapKVPress: window_size must be int, got True",
        ),
        (  # an inner press's own parameters are checked too
            [
                "method.params.press=AdaKVPress",
                "+method.params.press_params.press={press:SnapKVPress,kernel_size:x}",
            ],
            "method kvpress: kvpress SnapKVPress: kernel_size must be int, got 'x'",
        ),
        (
            ["method.params.press=AdaKVPress", "+method.params.press_params.press=7"],
            "method kvpress: kvpress AdaKVPress: press must be a press (its class name, or a mapping with "
            "`press`), got 7",
        ),
    ],
)
def test_kvpress_parameters_are_type_checked_before_the_model_loads(tmp_path, overrides, message):
    assert config_error_line(tmp_path, ["method=kvpress", *overrides]) == message


# ------------------------------------------------------------------------- 10. a locked sweep job
SWEEP = [*TINY, "method=full", "benchmark.n_samples=1", "benchmark.max_new_tokens=2,3"]


def test_a_sweep_with_a_locked_job_is_one_line_per_locked_job(tmp_path):
    from eval.sweep import plan

    args = ["-m", *SWEEP, f"results_dir={tmp_path}"]
    locked, free = job_dirs(args)
    store = JobStore(locked)
    store.lock()
    try:
        with pytest.raises(ConfigError) as error:
            plan(args)
    finally:
        store.unlock()
    (line,) = error.value.lines
    assert line.startswith(f"{locked} is being run by pid {os.getpid()} on host ")
    assert line.endswith("; wait for it or stop it") and not free.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed (pip install -e '.[slurm]')",
)
def test_a_submitit_sweep_with_a_locked_job_starts_no_job(tmp_path):
    """Before: the locked job failed inside submitit (exit 1, a 30-line UncompletedJobError) and its
    sibling kept running, an orphan. Now the sweep is refused before any job starts: one line."""
    args = ["-m", *SWEEP, f"results_dir={tmp_path / 'results'}"]
    locked, free = job_dirs(args)
    store = JobStore(locked)
    store.lock()
    try:
        out = run(
            [*args, "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'hydra'}"], timeout=120
        )
    finally:
        store.unlock()
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = error_lines(out)
    assert line.startswith(f"config error: {locked} is being run by pid {os.getpid()} on host ")
    assert not free.exists() and not (tmp_path / "hydra").exists()  # no job was submitted


# ------------------------------------------------------------------- 11. gpu_check keeps old results
def test_gpu_check_refuses_a_folder_holding_an_earlier_run(tmp_path):
    (tmp_path / "log.txt").write_text("an earlier run\n")
    out = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert error_lines(out) == [
        f"gpu_check: {tmp_path} is not empty (an earlier run's results?): give a new or empty folder"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["log.txt"]
    assert (tmp_path / "log.txt").read_text() == "an earlier run\n"


# ----------------------------------------------------------------------- 12. an empty model depth
def test_a_random_model_with_an_empty_depth_is_refused(tmp_path):
    from centroidkv.models.loading import parse_model_name

    with pytest.raises(ValueError, match="the depth after ':' must be an integer in 1..32"):
        parse_model_name("random-llama3.1-8b:")
    assert parse_model_name("random-llama3.1-8b") == ("random-llama3.1-8b", None)
    line = config_error_line(tmp_path, ["model.name=random-llama3.1-8b:", "method=full"])
    assert line == (
        "model.name: model 'random-llama3.1-8b:': the depth after ':' must be an integer in 1..32"
    )


# ----------------------------------------------------------------------------------- 15. wording
def test_a_rerun_of_a_job_whose_every_record_failed_names_retry_failed(tmp_path):
    from eval.runner import NoSuccessError, config_yaml_of, run_job

    # centroidkv at 0.001 keeps no entry of a ~300-token toy prompt: every record fails
    overrides = ["method=centroidkv", "method.budget=0.001", "benchmark.n_samples=2"]
    cfg, raw = run_cfg(tmp_path, overrides)
    with pytest.raises(NoSuccessError):
        run_job(cfg, config_yaml_of(cfg, raw))
    before = (cfg.job_dir / "records.jsonl").read_text()
    with pytest.raises(NoSuccessError) as error:  # retries nothing: says how to retry
        run_job(cfg, config_yaml_of(cfg, raw))
    assert str(error.value).endswith(
        "the job is not marked done; a rerun skips failed records: retry_failed=true retries them"
    )
    assert (cfg.job_dir / "records.jsonl").read_text() == before  # nothing was retried
    retrying, raw = run_cfg(tmp_path, [*overrides, "retry_failed=true"])
    with pytest.raises(NoSuccessError) as error:
        run_job(retrying, config_yaml_of(retrying, raw))
    assert str(error.value).endswith("the job is not marked done")
