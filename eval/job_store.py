"""One job's folder held by one run (`JobStore`): its lock, identity, records and done.json, under
the safety rules of `eval.records`."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from centroidkv.errors import first_line
from eval.records import (
    CONFIG,
    DONE,
    LOCK,
    RECORDS,
    JobLocked,
    JobMismatch,
    ResultsFolderError,
    ResultsWriteError,
    _reason,
    atomic_write,
    describe_foreign,
    identity_changes,
    scan_records,
)

# What a resumed job's env.json keeps of its earlier runs: each value it ran under besides this run's.
EARLIER_ENV = {"git_commit": "earlier_git_commits", "cpu": "earlier_cpus"}


class JobStore:
    """One job's folder."""

    def __init__(self, job_dir: Path):
        self.dir = Path(job_dir)
        self.records_path = self.dir / RECORDS
        self.n_dropped = 0  # torn or corrupt lines dropped by the last `load`
        self.kept_aside: Path | None = None  # where the last `load` kept the lines it dropped
        self._lock_fd: int | None = None

    @property
    def finished(self) -> bool:
        return os.path.exists(self.dir / DONE)  # never raises (a name too long is not finished)

    def skipped_as_finished(self, overwrite: bool) -> bool:
        """Whether a run skips this job as finished: it needs no write, so neither the folder check nor
        the lock (a read-only filesystem included); only its identity is checked."""
        return not overwrite and self.finished and not self.dir.is_symlink()

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
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            except OSError as error:  # e.g. a folder named .lock (refused by refuse_links first)
                raise ResultsFolderError(f"cannot read {self.dir / LOCK}: {_reason(error)}") from None
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
    def _saved_config(self) -> dict[str, Any]:
        """config.yaml as a mapping; empty when it is missing, unreadable or not YAML."""
        try:
            saved = OmegaConf.to_container(OmegaConf.load(self.dir / CONFIG))
        except Exception:  # missing, unreadable or not YAML: nothing to compare with
            return {}
        return saved if isinstance(saved, dict) else {}

    def config_problem(self) -> str | None:
        """Why an existing config.yaml cannot be read as a mapping (first line), or None when it can
        or when there is none: a damaged file is not "an older run"."""
        if not (self.dir / CONFIG).exists():
            return None
        try:
            saved = OmegaConf.load(self.dir / CONFIG)
        except Exception as error:  # unreadable, not UTF-8 or not YAML
            return first_line(error)
        return None if isinstance(OmegaConf.to_container(saved), dict) else "not a mapping"

    def saved_identity(self) -> dict[str, Any] | None:
        """The identity saved in config.yaml, or None (no config, or one written before identities)."""
        identity = self._saved_config().get("identity")
        return identity if isinstance(identity, dict) else None

    def saved_owner(self) -> dict[str, str] | None:
        """The job config.yaml names ({model, experiment, job} -> value, those it has), or None."""
        saved = self._saved_config()
        validated = saved.get("validated") if isinstance(saved.get("validated"), dict) else {}
        identity = saved.get("identity") if isinstance(saved.get("identity"), dict) else {}
        model = validated.get("model") if isinstance(validated.get("model"), dict) else {}
        owner = {
            "model": identity.get("model.name", model.get("name")),
            "experiment": validated.get("experiment"),
            "job": validated.get("job"),
        }
        owner = {key: value for key, value in owner.items() if isinstance(value, str)}
        return owner or None

    def check_own_records(self, owner: dict[str, str]) -> None:
        """Raise JobMismatch when records.jsonl holds records of another job than `owner` (copied in):
        resuming would count them as the job's own, and one of them may hide a record of the job."""
        foreign = scan_records(self.records_path, owner).foreign
        if foreign:
            raise JobMismatch(
                f"{self.records_path} holds {len(foreign)} record(s) of another job "
                f"({describe_foreign(foreign, owner)}); move them out of the file, or pass "
                "overwrite=true (--force) to start the job again"
            )

    def check_identity(self, identity: dict[str, Any]) -> None:
        """Raise JobMismatch when the folder holds results of a job with another identity."""
        if not self.has_results:
            return
        saved = self.saved_identity()
        if saved is None and self.finished:  # a finished job of an older version: skipped, nothing added
            return
        if saved is None:
            unreadable = self.config_problem()
            why = f"its {CONFIG} cannot be read ({unreadable})" if unreadable else "an older run"
            raise JobMismatch(
                f"{self.dir} holds results without a saved identity ({why}): pass overwrite=true "
                "(--force) to start the job again, or choose another experiment_name"
            )
        differing = identity_changes(saved, identity)
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
        """Write the job's config and environment; a resumed job's env.json keeps the commits and the
        CPUs its earlier runs were on (`earlier_git_commits`, `earlier_cpus`), whose records are still
        in the file."""
        atomic_write(self.dir / CONFIG, config_yaml)
        before, env = self._earlier_env(), dict(env)
        for key, earlier in EARLIER_ENV.items():
            kept = [*before.get(earlier, []), before.get(key)]
            env[earlier] = [value for value in dict.fromkeys(kept) if value and value != env.get(key)]
        atomic_write(self.dir / "env.json", json.dumps(env, indent=2, default=str) + "\n")

    def _earlier_env(self) -> dict[str, Any]:
        """The env.json of this job's earlier runs, when it has records."""
        try:
            return json.loads((self.dir / "env.json").read_text()) if self.records_path.exists() else {}
        except (OSError, ValueError):
            return {}

    def load(self) -> list[dict[str, Any]]:
        """Existing records, cleaned on disk when a previous run was killed mid-write; complete lines
        that are not records are kept aside first, in `records.jsonl.dropped-<time>`."""
        found = scan_records(self.records_path)
        self.n_dropped = found.n_dropped
        if found.dirty:
            if found.bad_lines:
                self.kept_aside = _unused(self.dir / f"{RECORDS}.dropped-{time.strftime('%Y%m%d-%H%M%S')}")
                atomic_write(self.kept_aside, "".join(found.bad_lines))
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


def _unused(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


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


def iter_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """All records under the given files or folders (searched recursively for records.jsonl), each
    with `_identity`: its job's saved identity (config.yaml beside the file), or None."""
    for path in paths:
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.rglob(RECORDS))
        for file in files:
            store = JobStore(file.parent)
            owner = store.saved_owner()
            found = scan_records(file, owner)
            identity = store.saved_identity()
            if found.n_dropped:
                print(f"[records] {file}: {found.n_dropped} torn or corrupt line(s) skipped", file=sys.stderr)
            if found.foreign:
                print(
                    f"[records] {file}: {len(found.foreign)} record(s) of another job skipped "
                    f"({describe_foreign(found.foreign, owner or {})})",
                    file=sys.stderr,
                )
            for record in found.records:
                record.setdefault("job", file.parent.name)
                record.setdefault("experiment", file.parent.parent.name)
                record["_identity"] = identity
                yield record
