"""Issue 40, item 6: `scripts/run.py <the same command as a finished job>` says "[skip] ... is finished"
before torch is imported (before: 13-38 s, the methods built for the job's identity), from the key a
full check left in the folder (`eval.finished_jobs`); anything the key does not vouch for goes through
the full check as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eval import finished_jobs
from eval.finished_jobs import FINISHED_KEY, finished_by_key, finished_key, remember

ROOT = Path(__file__).resolve().parent.parent
# Runs scripts/run.py as `python scripts/run.py` does, then says whether torch was imported.
PROBE = (
    "import runpy, sys; sys.argv = ['scripts/run.py', *sys.argv[1:]]\n"
    "runpy.run_path('scripts/run.py', run_name='__main__')\n"
    "print('torch imported:', 'torch' in sys.modules)"
)
CONFIG = {"model": {"name": "tiny-llama", "dtype": None, "device": None}, "experiment_name": "e",
          "results_dir": "r", "overwrite": False, "methods": ["full", "snapkv"]}  # fmt: skip


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_finished_job_is_skipped_before_torch_and_a_changed_key_goes_through_the_full_check(
    tmp_path, own_cache
):
    """In a cache of the test's own: another process calibrating in the user's cache changes nothing."""
    args = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false", f"results_dir={tmp_path}",
            "methods=[full,snapkv]", "budgets=[0.5]"]  # fmt: skip
    first = run(args)
    assert first.returncode == 0 and "[done]" in first.stdout, first.stderr
    (job_dir,) = [path.parent for path in tmp_path.glob("default/*/done.json")]
    key = (job_dir / FINISHED_KEY).read_text()
    skip = f"[skip] {job_dir} is finished"
    again = run(args)
    assert again.returncode == 0 and again.stdout.splitlines() == [
        f"{skip} (delete done.json or pass overwrite=true to rerun it)",
        "torch imported: False",
    ], again.stderr
    (job_dir / FINISHED_KEY).write_text("another key\n")  # e.g. a source or a head file changed since
    full = run(args)
    assert skip in full.stdout and "torch imported: True" in full.stdout, full.stderr
    assert (job_dir / FINISHED_KEY).read_text() == key  # the full check found it finished: key again
    forced = run([*args, "--force"])  # overwrite=true is never skipped
    assert "[done]" in forced.stdout and "torch imported: True" in forced.stdout, forced.stderr


def test_the_key_changes_with_the_config_the_head_files_and_the_device(tmp_path, monkeypatch):
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(finished_jobs, "GPU_DEVICE_FILES", (str(tmp_path / "no-gpu"),))
    key = finished_key(CONFIG, "methods=[full,snapkv]")
    assert key and key == finished_key(dict(CONFIG), "methods=[full,snapkv]")
    assert key != finished_key({**CONFIG, "budgets": [0.25]}, "methods=[full,snapkv]")
    assert key != finished_key(CONFIG, "methods=[full,snapkv],budgets=[0.5]")
    (tmp_path / "cache/outlier_heads").mkdir(parents=True)
    (tmp_path / "cache/outlier_heads/tiny-llama.json").write_text("{}")  # a calibration the job may read
    assert finished_key(CONFIG, "methods=[full,snapkv]") not in (None, key)
    assert finished_key({**CONFIG, "overwrite": True}, "") is None
    assert finished_key({**CONFIG, "model": {"name": "someone/some-hub-model"}}, "") is None
    (tmp_path / "no-gpu").touch()  # a GPU driver is visible: cuda or cpu is torch's to say
    assert finished_key(CONFIG, "") is None
    assert finished_key({**CONFIG, "model": {"name": "tiny-llama", "device": "cpu"}}, "") is not None


def test_the_key_reads_the_head_files_of_the_jobs_model_only(tmp_path, monkeypatch):
    """Issue 53, defect 12: calibrating another model leaves every finished job's key as it was (it
    hashed every head file in the cache); a head file of the job's model, of any score, changes it."""
    heads = tmp_path / "cache/outlier_heads"
    heads.mkdir(parents=True)
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(finished_jobs, "GPU_DEVICE_FILES", ())
    key = finished_key(CONFIG, "")
    for other in ("smollm2-135m.json", "tiny-mistral.streaming.json", "random-llama3.1-8b-2layers.json"):
        (heads / other).write_text("{}")
    assert finished_key(CONFIG, "") == key
    (heads / "tiny-llama.needle.json").write_text("{}")
    needle = finished_key(CONFIG, "")
    assert needle != key
    (heads / "tiny-llama.needle.json").write_text('{"changed": 1}')
    assert finished_key(CONFIG, "") not in (key, needle)
    cut = {**CONFIG, "model": {"name": "random-llama3.1-8b:2"}}
    before = finished_key(cut, "")
    (heads / "random-llama3.1-8b-2layers.json").write_text('{"calibrated": 2}')
    assert finished_key(cut, "") != before


def test_only_a_finished_folder_with_the_same_key_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(finished_jobs, "GPU_DEVICE_FILES", ())
    config, overrides = {**CONFIG, "results_dir": str(tmp_path)}, "methods=[full,snapkv]"
    job_dir = tmp_path / "e" / f"toy-2methods-0.5-{finished_jobs.override_hash(overrides)}"
    job_dir.mkdir(parents=True)
    remember(job_dir, config, overrides, "cpu")
    assert finished_by_key(config, overrides) is None  # no done.json: not finished
    (job_dir / "done.json").write_text("{}")
    assert finished_by_key(config, overrides) == job_dir
    assert finished_by_key({**config, "budgets": [0.25]}, overrides) is None
    (job_dir / FINISHED_KEY).unlink()
    remember(job_dir, config, overrides, "cuda:0")  # resolved to another device than the key's: no key
    assert not (job_dir / FINISHED_KEY).exists()
