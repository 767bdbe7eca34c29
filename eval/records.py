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
  the file is rewritten atomically when anything was cleaned; a complete line that is not a record
  (not JSON, a field missing or of the wrong type) is kept aside in `records.jsonl.dropped-<time>`;
- records of another job (their `model`, `experiment` or `job` differs from the job's: copied in) are
  never read as the job's own: resuming refuses them, tables skip them;
- nothing is written through a symbolic link: a job folder, its experiment folder or a file in it that
  is a link is refused before any work, and files are opened with O_NOFOLLOW; a folder where the
  runner keeps a file (records.jsonl, .lock, ...) and a name longer than the file system allows are
  refused before any work too;
- `done.json` is written last, and only when some record succeeded: a job that has it is finished
  and is skipped on rerun. Every OSError while writing becomes one `ResultsWriteError` line.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from centroidkv.files import write_atomic
from centroidkv.parsing import is_number

RECORDS = "records.jsonl"
DONE = "done.json"
CONFIG = "config.yaml"
LOCK = ".lock"

# A record is identified by these fields: one line per sample x method variant (params) x budget.
KEY_FIELDS = ("benchmark", "task", "length", "sample_id", "method", "variant", "params", "budget")
# A JSON line without these is not a record (it is dropped and counted, as a torn line is).
REQUIRED_FIELDS = ("benchmark", "sample_id", "method", "budget", "status")
# The files the runner keeps in a job folder: each must be a file when it exists.
JOB_FILES = (RECORDS, DONE, CONFIG, LOCK, "env.json")
# The record fields that say which job wrote a record (`JobStore.saved_owner`).
OWNER_FIELDS = ("model", "experiment", "job")
NAME_MAX = 255  # bytes in one file or folder name (ext4, xfs, btrfs, APFS)


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


# field -> (what it must be, the check); a field that is absent or null is not checked, except the
# required ones, whose presence `REQUIRED_FIELDS` demands.
FIELD_TYPES: dict[str, tuple[str, Any]] = {
    "benchmark": ("a string", lambda v: isinstance(v, str)),
    "sample_id": ("a string or an integer", lambda v: isinstance(v, str) or is_number(v)),
    "method": ("a string", lambda v: isinstance(v, str)),
    "variant": ("a string", lambda v: isinstance(v, str)),
    "task": ("a string", lambda v: isinstance(v, str)),
    "status": ("a string", lambda v: isinstance(v, str)),
    "budget": ("a number", is_number),
    "length": ("a number", is_number),
    "params": ("a mapping", lambda v: isinstance(v, dict)),
    "score": ("a number", is_number),
    **{
        name: ("a number", is_number) for name in ("tpot", "ttft", "kv_bytes", "kv_ratio")
    },  # tables read them
    **{name: ("a string", lambda v: isinstance(v, str)) for name in OWNER_FIELDS},
}


def record_problem(record: Any) -> str | None:
    """Why a parsed JSON line is not a record (a required field missing, a field of the wrong type),
    or None when it is one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [name for name in REQUIRED_FIELDS if record.get(name) is None]
    if missing:
        return f"no {', '.join(missing)}"
    for name, (kind, check) in FIELD_TYPES.items():
        if record.get(name) is not None and not check(record[name]):
            return f"{name} must be {kind}, got {record[name]!r}"
    return None


def foreign_fields(record: dict[str, Any], owner: dict[str, str]) -> dict[str, Any]:
    """The fields of `record` naming another job than `owner` ({model, experiment, job} -> value)."""
    return {k: record[k] for k, v in owner.items() if record.get(k) is not None and record[k] != v}


def record_key(record: dict[str, Any]) -> str:
    # Records written before variants existed have none: their variant is the method's name.
    values = {**record, "variant": record.get("variant") or record.get("method")}
    return json.dumps([values.get(k) for k in KEY_FIELDS], sort_keys=True, default=str)


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old file or the whole new one
    (`centroidkv.files.write_atomic`); every OSError is one ResultsWriteError line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as error:
        raise ResultsWriteError(f"cannot write {path}: {_reason(error)}") from None


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
    bad_lines: list[str] = field(default_factory=list)  # the complete ones of those (kept aside)
    foreign: list[dict[str, Any]] = field(default_factory=list)  # records of another job

    @property
    def dirty(self) -> bool:
        """Whether the file holds anything but one line per record (dropped or superseded lines)."""
        return len(self.records) != self.n_lines


def finished_message(job_dir: Path) -> str:
    """The one line for a finished job that is skipped."""
    return f"[skip] {job_dir} is finished (delete done.json or pass overwrite=true to rerun it)"


def scan_records(path: Path, owner: dict[str, str] | None = None) -> RecordsFile:
    """Records of a jsonl file, de-duplicated by key (the last wins), and the lines dropped.

    `owner`: the job the file belongs to ({model, experiment, job} -> value, `JobStore.saved_owner`); a
    record naming another is set apart in `foreign` and never replaces one of the job's own."""
    found = RecordsFile()
    if not path.exists():
        return found
    by_key: dict[str, dict[str, Any]] = {}
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            found.n_lines += 1
            try:
                if not line.endswith("\n"):  # torn write: the job was killed mid-line
                    found.n_dropped += 1
                    continue
                record = json.loads(line)
                problem = record_problem(record)
                if problem is not None:
                    raise ValueError(f"valid JSON, but not a record: {problem}")
                key = record_key(record)
            except (ValueError, TypeError, AttributeError):  # not JSON, or not a record
                found.n_dropped += 1
                found.bad_lines.append(line)
                continue
            if owner and foreign_fields(record, owner):
                found.foreign.append(record)
                continue
            by_key[key] = record
    found.records = list(by_key.values())
    return found


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Records of a jsonl file, de-duplicated by key (last wins); also whether anything was cleaned."""
    found = scan_records(path)
    return found.records, found.dirty


def check_results_folder(job_dir: Path, needed_bytes: int = 0) -> None:
    """Raise ResultsFolderError unless `job_dir` can be created (or exists) and written, with at least
    `needed_bytes` free. Writes nothing that stays: the probe file is removed at once."""
    job_dir = Path(job_dir)
    too_long = [part for part in job_dir.parts if len(os.fsencode(part)) > NAME_MAX]
    if too_long:
        raise ResultsFolderError(
            f"results folder {job_dir}: the name {too_long[0][:40]}... has {len(os.fsencode(too_long[0]))} "
            f"bytes, more than a file system allows ({NAME_MAX}); choose a shorter one"
        )
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
    folder is a symbolic link (writing through it would touch a file outside the results folder), or
    when one of the runner's files (`JOB_FILES`) is anything but a file, e.g. a folder."""
    job_dir = Path(job_dir)
    entries = sorted(job_dir.iterdir()) if job_dir.is_dir() and not job_dir.is_symlink() else []
    for path in (job_dir.parent, job_dir, *entries):
        if path.is_symlink():
            raise ResultsFolderError(
                f"{path} is a symbolic link: the runner never writes through links; remove it"
            )
    for path in entries:
        if path.name in JOB_FILES and not path.is_file():
            what = "a folder" if path.is_dir() else "not a regular file"
            raise ResultsFolderError(f"{path} is {what}, where the runner keeps a file; remove it")


def describe_foreign(records: list[dict[str, Any]], owner: dict[str, str]) -> str:
    """`model smollm2-135m, job other` for records of another job: the values that differ, first seen."""
    differing: dict[str, Any] = {}
    for record in records:
        for key, value in foreign_fields(record, owner).items():
            differing.setdefault(key, value)
    return ", ".join(f"{key} {_short(str(value))}" for key, value in differing.items())


ABSENT_VALUE = "<absent>"  # what a key missing from an identity compares and prints as


def differing_keys(identities: list[dict[str, Any]]) -> list[str]:
    """The keys whose value is not the same in every identity (absent counts as a value), sorted."""
    keys = sorted(set().union(*identities))
    return [
        key
        for key in keys
        if len({json.dumps(i.get(key, ABSENT_VALUE), sort_keys=True, default=str) for i in identities}) > 1
    ]


def identity_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every key whose value differs between two identities."""
    return [
        f"{key}: {_short(saved.get(key, ABSENT_VALUE))} -> {_short(new.get(key, ABSENT_VALUE))}"
        for key in differing_keys([saved, new])
    ]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def cpu_name() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo, else what the platform says) and the vector
    instructions torch's CPU kernels use on it, e.g. "Intel(R) Xeon(R) Processor @ 2.80GHz (AVX512)": greedy
    answers can differ in their last bits between two CPUs, so a record's CPU is part of its provenance."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    except OSError:
        name = None
    name = name or platform.processor() or None
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # provenance must never stop a run
        capability = None
    return f"{name} ({capability})" if name and capability else name


def environment(device: str) -> dict[str, Any]:
    """Git commit, library versions, the device and the CPU, for env.json."""
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
        "cpu": cpu_name(),
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
