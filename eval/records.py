"""The results store: `results/<experiment>/<job>/` with records.jsonl, config.yaml, env.json, done.json.

Safety rules:
- metadata files are written atomically (temporary file in the same folder, fsync, rename);
- records are appended one complete JSON line at a time and fsync'd, so a killed job loses at most
  the line being written; on load a torn last line is dropped and records are de-duplicated by key
  (the last one wins), and the file is rewritten atomically when anything was cleaned;
- `done.json` is written last: a job that has it is finished and is skipped on rerun.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

RECORDS = "records.jsonl"
DONE = "done.json"

# A record is identified by these fields: one line per sample x method variant (params) x budget.
KEY_FIELDS = ("benchmark", "task", "length", "sample_id", "method", "variant", "params", "budget")


def record_key(record: dict[str, Any]) -> str:
    # Records written before variants existed have none: their variant is the method's name.
    values = {**record, "variant": record.get("variant") or record.get("method")}
    return json.dumps([values.get(k) for k in KEY_FIELDS], sort_keys=True, default=str)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Records of a jsonl file, de-duplicated by key (last wins); also whether anything was cleaned."""
    if not path.exists():
        return [], False
    by_key: dict[str, dict[str, Any]] = {}
    n_lines, dirty = 0, False
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            n_lines += 1
            if not line.endswith("\n"):  # torn write: the job was killed mid-line
                dirty = True
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dirty = True
                continue
            by_key[record_key(record)] = record
    dirty = dirty or len(by_key) != n_lines
    return list(by_key.values()), dirty


def iter_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """All records under the given files or folders (searched recursively for records.jsonl)."""
    for path in paths:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.rglob(RECORDS))
        for file in files:
            records, _ = read_records(file)
            for record in records:
                record.setdefault("job", file.parent.name)
                record.setdefault("experiment", file.parent.parent.name)
                yield record


class JobStore:
    """One job's folder."""

    def __init__(self, job_dir: Path):
        self.dir = Path(job_dir)
        self.records_path = self.dir / RECORDS

    @property
    def finished(self) -> bool:
        return (self.dir / DONE).exists()

    def prepare(self, config_yaml: str, env: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / "config.yaml", config_yaml)
        atomic_write(self.dir / "env.json", json.dumps(env, indent=2, default=str) + "\n")

    def load(self) -> list[dict[str, Any]]:
        """Existing records, cleaned on disk when a previous run was killed mid-write."""
        records, dirty = read_records(self.records_path)
        if dirty:
            atomic_write(self.records_path, "".join(json.dumps(r, default=str) + "\n" for r in records))
        return records

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self.records_path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def finish(self, summary: dict[str, Any]) -> None:
        atomic_write(self.dir / DONE, json.dumps(summary, indent=2, default=str) + "\n")


def environment(device: str) -> dict[str, Any]:
    """Git commit, library versions and the device, for env.json."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    versions = {}
    for package in ("torch", "transformers", "hydra-core", "omegaconf", "wandb", "numpy", "centroidkv"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    env: dict[str, Any] = {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "device": device,
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        if device.startswith("cuda"):
            env["gpu"] = torch.cuda.get_device_name(torch.device(device))
            env["cuda"] = torch.version.cuda
    except Exception as error:  # environment capture must never stop a run
        env["device_error"] = str(error)
    return env
