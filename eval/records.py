"""The results store: `results/<experiment>/<job>/` with records.jsonl, config.yaml, env.json, done.json.

Safety rules:
- a job folder is checked before any work (it can be created and written, and has room for the
  records) and held by one run at a time: an exclusive lock (`.lock`, with the holder's pid and host)
  is taken before the model loads, released by the kernel if the holder dies;
- a job is identified by everything that changes its numbers (`config.yaml`'s `identity`): resuming
  it with another identity is refused, naming the keys that differ, unless the job is overwritten
  (the previous records are then kept aside as `records.jsonl.replaced-<time>`);
- metadata files are written atomically (temporary file in the same folder, fsync, rename);
- records are appended one complete JSON line at a time and fsync'd, so a killed job loses at most
  the line being written (a failed write is cut back to the last complete line); on load, torn or
  corrupt lines are dropped and counted, records are de-duplicated by key (the last one wins), and
  the file is rewritten atomically when anything was cleaned;
- nothing is written through a symbolic link: a job folder, its experiment folder or a file in it that
  is a link is refused before any work, and files are opened with O_NOFOLLOW;
- `done.json` is written last, and only when some record succeeded: a job that has it is finished
  and is skipped on rerun. Every OSError while writing becomes one `ResultsWriteError` line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

RECORDS = "records.jsonl"
DONE = "done.json"
CONFIG = "config.yaml"
LOCK = ".lock"

# A record is identified by these fields: one line per sample x method variant (params) x budget.
KEY_FIELDS = ("benchmark", "task", "length", "sample_id", "method", "variant", "params", "budget")
# A JSON line without these is not a record (it is dropped and counted, as a torn line is).
REQUIRED_FIELDS = ("benchmark", "sample_id", "method", "budget", "status")


class JobError(RuntimeError):
    """A job cannot start or finish; the message is one line, `exit_code` the CLI's exit status."""

    exit_code = 1


class ResultsFolderError(JobError):
    """The results folder cannot be created or written, or has no room (checked before any work)."""

    exit_code = 2


class ResultsWriteError(JobError):
    """An OSError while writing a results file; everything written before it is intact."""


class JobLocked(JobError):
    """Another live run holds the job's lock."""

    exit_code = 2


class JobMismatch(JobError):
    """The job folder holds records of another configuration."""

    exit_code = 2


def record_key(record: dict[str, Any]) -> str:
    # Records written before variants existed have none: their variant is the method's name.
    values = {**record, "variant": record.get("variant") or record.get("method")}
    return json.dumps([values.get(k) for k in KEY_FIELDS], sort_keys=True, default=str)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old file or the whole new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise ResultsWriteError(f"cannot write {path}: {_reason(error)}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise ResultsWriteError(f"cannot write {path}: {_reason(error)}") from None
        raise


def _reason(error: OSError) -> str:
    if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link
        return "it is a symbolic link, which the runner never writes through"
    return error.strerror or str(error)


@dataclass
class RecordsFile:
    """What reading a records file found."""

    records: list[dict[str, Any]] = field(default_factory=list)
    n_lines: int = 0
    n_dropped: int = 0  # torn (no newline: killed mid-write) or corrupt lines

    @property
    def dirty(self) -> bool:
        """Whether the file holds anything but one line per record (dropped or superseded lines)."""
        return len(self.records) != self.n_lines


def scan_records(path: Path) -> RecordsFile:
    """Records of a jsonl file, de-duplicated by key (the last wins), and the lines dropped."""
    found = RecordsFile()
    if not path.exists():
        return found
    by_key: dict[str, dict[str, Any]] = {}
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            found.n_lines += 1
            try:
                if not line.endswith("\n"):  # torn write: the job was killed mid-line
                    raise ValueError("torn line")
                record = json.loads(line)
                if not isinstance(record, dict) or not all(k in record for k in REQUIRED_FIELDS):
                    raise ValueError("valid JSON, but not a record")
                key = record_key(record)
            except (ValueError, TypeError, AttributeError):  # torn, not JSON, or not a record
                found.n_dropped += 1
                continue
            by_key[key] = record
    found.records = list(by_key.values())
    return found


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Records of a jsonl file, de-duplicated by key (last wins); also whether anything was cleaned."""
    found = scan_records(path)
    return found.records, found.dirty


def iter_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """All records under the given files or folders (searched recursively for records.jsonl), each
    with `_identity`: its job's saved identity (config.yaml beside the file), or None."""
    for path in paths:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.rglob(RECORDS))
        for file in files:
            found = scan_records(file)
            identity = JobStore(file.parent).saved_identity()
            if found.n_dropped:
                print(f"[records] {file}: {found.n_dropped} torn or corrupt line(s) skipped", file=sys.stderr)
            for record in found.records:
                record.setdefault("job", file.parent.name)
                record.setdefault("experiment", file.parent.parent.name)
                record["_identity"] = identity
                yield record


def check_results_folder(job_dir: Path, needed_bytes: int = 0) -> None:
    """Raise ResultsFolderError unless `job_dir` can be created (or exists) and written, with at least
    `needed_bytes` free. Writes nothing that stays: the probe file is removed at once."""
    job_dir = Path(job_dir)
    refuse_links(job_dir)
    existing = job_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ResultsFolderError(f"results folder {job_dir} cannot be created: {existing} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".centroidkv-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        where = "" if existing == job_dir else f" (in {existing})"
        raise ResultsFolderError(
            f"results folder {job_dir} cannot be written{where}: {_reason(error)}"
        ) from None
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ResultsFolderError(
            f"results folder {job_dir}: {free / 2**20:.1f} MB free, the job's records need about "
            f"{needed_bytes / 2**20:.1f} MB"
        )


def refuse_links(job_dir: Path) -> None:
    """Raise ResultsFolderError when the job folder, its experiment folder or any file in the job
    folder is a symbolic link: writing through it would touch a file outside the results folder."""
    job_dir = Path(job_dir)
    entries = sorted(job_dir.iterdir()) if job_dir.is_dir() and not job_dir.is_symlink() else []
    for path in (job_dir.parent, job_dir, *entries):
        if path.is_symlink():
            raise ResultsFolderError(
                f"{path} is a symbolic link: the runner never writes through links; remove it"
            )


def differing_keys(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every key whose value differs between two identities."""
    lines = []
    for key in sorted(set(saved) | set(new)):
        old, now = saved.get(key, "<absent>"), new.get(key, "<absent>")
        if json.dumps(old, sort_keys=True, default=str) != json.dumps(now, sort_keys=True, default=str):
            lines.append(f"{key}: {_short(old)} -> {_short(now)}")
    return lines


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


class JobStore:
    """One job's folder."""

    def __init__(self, job_dir: Path):
        self.dir = Path(job_dir)
        self.records_path = self.dir / RECORDS
        self.n_dropped = 0  # torn or corrupt lines dropped by the last `load`
        self._lock_fd: int | None = None

    @property
    def finished(self) -> bool:
        return (self.dir / DONE).exists()

    @property
    def has_results(self) -> bool:
        return self.finished or (self.records_path.exists() and self.records_path.stat().st_size > 0)

    # --- the lock ------------------------------------------------------------------------------
    def lock(self) -> str | None:
        """Take the job's exclusive lock (creating the folder); returns the holder of a stale lock it
        took over (a run that died), or None. Raises JobLocked while a live run holds it."""
        path = self.dir / LOCK
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise ResultsFolderError(f"cannot create {path}: {_reason(error)}") from None
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._locked_by(holder) from None
        except OSError as error:  # a file system without locks: trust a recorded live holder
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                os.close(fd)
                raise ResultsFolderError(f"cannot lock {path}: {_reason(error)}") from None
            if _alive(holder):
                os.close(fd)
                raise self._locked_by(holder) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._lock_fd = fd
        return _holder(holder) if holder else None

    def check_not_running(self) -> None:
        """Raise JobLocked while a live run holds the job's lock; takes nothing and writes nothing (a
        sweep checks every job this way before any of them starts)."""
        try:
            fd = os.open(self.dir / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # no lock file (or a link, refused by refuse_links): nobody holds it
            return
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by os.close below
            except BlockingIOError:
                raise self._locked_by(holder) from None
            except OSError:  # a file system without locks: trust a recorded live holder
                if _alive(holder):
                    raise self._locked_by(holder) from None
        finally:
            os.close(fd)

    def _locked_by(self, holder: str) -> JobLocked:
        return JobLocked(f"{self.dir} is being run by {_holder(holder)}; wait for it or stop it")

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)  # an empty lock file: nobody held it when it was released
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- identity -----------------------------------------------------------------------------
    def saved_identity(self) -> dict[str, Any] | None:
        """The identity saved in config.yaml, or None (no config, or one written before identities)."""
        try:
            saved = OmegaConf.to_container(OmegaConf.load(self.dir / CONFIG))
        except Exception:  # missing, unreadable or not YAML: no identity to compare with
            return None
        return saved.get("identity") if isinstance(saved, dict) else None

    def check_identity(self, identity: dict[str, Any]) -> None:
        """Raise JobMismatch when the folder holds results of a job with another identity."""
        if not self.has_results:
            return
        saved = self.saved_identity()
        if saved is None and self.finished:  # a finished job of an older version: skipped, nothing added
            return
        if saved is None:
            raise JobMismatch(
                f"{self.dir} holds results without a saved identity (an older run): pass overwrite=true "
                "(--force) to start the job again, or choose another experiment_name"
            )
        differing = differing_keys(saved, identity)
        if differing:
            shown = "; ".join(differing[:6]) + (f"; +{len(differing) - 6} more" if len(differing) > 6 else "")
            raise JobMismatch(
                f"{self.dir} holds results of another config ({shown}); rerun with that config, choose "
                "another experiment_name, or pass overwrite=true (--force) to start the job again"
            )

    def set_aside(self) -> Path | None:
        """Overwrite: move the previous records aside (kept, not read by tables) and forget done.json."""
        kept = None
        try:
            if self.records_path.exists():
                kept = self.dir / f"{RECORDS}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(self.records_path, kept)
            (self.dir / DONE).unlink(missing_ok=True)
        except OSError as error:
            raise ResultsWriteError(f"cannot set aside the records of {self.dir}: {_reason(error)}") from None
        return kept

    # --- files --------------------------------------------------------------------------------
    def prepare(self, config_yaml: str, env: dict[str, Any]) -> None:
        atomic_write(self.dir / CONFIG, config_yaml)
        atomic_write(self.dir / "env.json", json.dumps(env, indent=2, default=str) + "\n")

    def load(self) -> list[dict[str, Any]]:
        """Existing records, cleaned on disk when a previous run was killed mid-write."""
        found = scan_records(self.records_path)
        self.n_dropped = found.n_dropped
        if found.dirty:
            atomic_write(self.records_path, "".join(json.dumps(r, default=str) + "\n" for r in found.records))
        return found.records

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=str) + "\n").encode()
        try:
            fd = os.open(self.records_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise ResultsWriteError(f"cannot write {self.records_path}: {_reason(error)}") from None
        end = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):  # a short write (disk full) raises on the next call
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except OSError as error:
            try:  # cut the partial line: the file keeps every record written before, whole
                os.ftruncate(fd, end)
            except OSError:
                pass
            raise ResultsWriteError(f"cannot write {self.records_path}: {_reason(error)}") from None
        finally:
            os.close(fd)

    def finish(self, summary: dict[str, Any]) -> None:
        atomic_write(self.dir / DONE, json.dumps(summary, indent=2, default=str) + "\n")


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return "another run"


def _alive(text: str) -> bool:
    """Whether a recorded lock holder is a live process (on another host: assume it is)."""
    try:
        info = json.loads(text)
    except ValueError:
        return False
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


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
