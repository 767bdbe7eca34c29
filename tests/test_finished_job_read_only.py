"""A finished job is skipped without writing, and passes the launch check on a read-only file
system (issue 39, D11)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_bad_records import finished_job

from eval import runner, sweep
from eval.job_store import JobStore
from eval.records import ResultsFolderError
from eval.run_config import ConfigError
from eval.runner import config_yaml_of, run_job

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ D11. a finished job on a read-only filesystem
def file_bytes(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def refusing_writes(folder: Path):
    """A stand-in for every write check of `folder` on a read-only filesystem."""

    def read_only(*args, **kwargs):
        raise ResultsFolderError(f"cannot write in {folder}: Read-only file system")

    return read_only


def test_a_finished_job_is_skipped_without_writing(tmp_path, monkeypatch, capsys):
    """Before: the folder's write probe and the lock ran first, so a read-only filesystem refused a
    job that needed no write."""
    cfg, raw, records = finished_job(tmp_path)
    before = file_bytes(cfg.job_dir)
    read_only = refusing_writes(cfg.job_dir)
    monkeypatch.setattr(runner, "check_results_folder", read_only)
    monkeypatch.setattr(JobStore, "lock", read_only)
    assert run_job(cfg, config_yaml_of(cfg, raw)) is None
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"[skip] {cfg.job_dir} is finished (delete done.json or pass overwrite=true to rerun it)")
    )
    assert file_bytes(cfg.job_dir) == before


def test_a_finished_job_on_a_read_only_filesystem_passes_the_launch_check(tmp_path, monkeypatch):
    """Before: run.py's check of every job folder before launch (`eval.sweep.check_job_folders`)
    probed the folder for writing first, so `scripts/run.py` refused a finished job on a read-only
    filesystem ("cannot be written: Read-only file system", exit 2) before the runner could skip it."""
    cfg, raw, records = finished_job(tmp_path)
    before = file_bytes(cfg.job_dir)
    read_only = refusing_writes(cfg.job_dir)
    monkeypatch.setattr(sweep, "check_results_folder", read_only)
    monkeypatch.setattr(JobStore, "check_not_running", read_only)
    sweep.check_job_folders([cfg])  # skipped as finished: only its identity is checked
    assert file_bytes(cfg.job_dir) == before
    with pytest.raises(ConfigError, match="Read-only file system"):  # a job that would write is refused
        sweep.check_job_folders([dataclasses.replace(cfg, overwrite=True)])
