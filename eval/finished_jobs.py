"""A finished job recognised before torch is imported, so that `scripts/run.py <the same command>`
says "[skip] ... is finished" in well under 2 s.

The full check builds the job's RunConfig (the methods' effective parameters, variants and head files,
the device), which imports torch and transformers (6-10 s), then compares its identity with the one
the folder saved. When that check finds the job finished under the same identity (after its run, or
on a skip), `remember` leaves in the folder a key (FINISHED_KEY) of everything that identity and the
folder's name are computed from: the composed config and its override string; the sources (the
library and the methods' packages with the installed distributions, as in the cached schema's
fingerprint, and the harness's eval/ and configs/); the head files of the job's model (the user's
calibrations and the package's, of every score: no other model's calibration touches the key), and
any file or folder the config names; the device the model resolves to; the interpreter. `finished_by_key`
computes the same key without torch: an equal key means the full check would skip the job. Anything
else (a source touched, a head file calibrated, overwrite=true, a Hub id, a visible GPU when no
device is given) leaves the decision to the full check, which is then one slow start.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from centroidkv.calibrate import PACKAGED_DIR, user_head_dir
from centroidkv.files import write_atomic
from centroidkv.models.model_names import MODEL_NAMES, cache_dir, model_identity
from centroidkv.schema import fingerprint
from eval.job_names import override_hash
from eval.job_store import JobStore

FINISHED_KEY = "finished.key"
KEY_VERSION = 2  # 2: the head files of the job's model only
ROOT = Path(__file__).resolve().parent.parent
HARNESS_SOURCES = (ROOT / "eval", ROOT / "configs")
NAMING_NODES = ("model", "method", "methods", "benchmark")  # where a file or folder the job reads is named
GPU_DEVICE_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")


def _device(config: dict[str, Any]) -> str | None:
    """The device the model resolves to, known without torch: the one the config names, else cpu
    when no GPU driver is visible; None (unknown) otherwise."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    device = model.get("device")
    if device is not None:
        return str(device).split(":")[0]
    return None if any(Path(path).exists() for path in GPU_DEVICE_FILES) else "cpu"


def _stats(root: Path) -> list[str]:
    """Path, size and modification time of every file under `root` (itself when a file)."""
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    else:
        return [f"{root}|absent"]
    return [f"{p}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files]


def _head_files(model_name: str) -> list[Path]:
    """The head files `heads_file=<score>` may read for the model: the user's calibrations and the
    package's whose name starts with the model's head-file stem (`centroidkv.calibrate.head_file_key`,
    known here without torch as its identity up to a depth: every score and every depth of a
    paper-shaped model, a few more files at worst, never one fewer)."""
    stem = model_identity(model_name).partition(":")[0]
    folders = ((user_head_dir(), stem), (PACKAGED_DIR, f"outlier_heads_{stem}"))
    return sorted(
        path
        for folder, prefix in folders
        if folder.is_dir()
        for path in folder.iterdir()
        if path.name.startswith(prefix) and path.suffix == ".json"
    )


def _named_paths(value: Any) -> list[Path]:
    """Every existing file or folder that a string of the config names (a head file, a model folder)."""
    if isinstance(value, dict):
        return [path for item in value.values() for path in _named_paths(item)]
    if isinstance(value, list):
        return [path for item in value for path in _named_paths(item)]
    if isinstance(value, str) and value and ("/" in value or "." in value):
        try:
            return [Path(value).resolve()] if Path(value).exists() else []
        except OSError:
            return []
    return []


def finished_key(config: dict[str, Any], override_dirname: str) -> str | None:
    """The key of a composed job config (plain, without the `hydra` node) and its override string;
    None when the identity could differ without the key changing (see the module's docstring)."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    name = str(model.get("name"))
    device = _device(config)
    if config.get("overwrite") or device is None:
        return None
    if name.split(":")[0] not in MODEL_NAMES and not Path(name).exists():  # a Hub id: its files may change
        return None
    digest = hashlib.sha256()
    parts = [f"{KEY_VERSION}", json.dumps(config, sort_keys=True, default=str), override_dirname.strip()]
    parts += [fingerprint(), sys.executable, sys.version, device, str(cache_dir())]
    named = _named_paths([config.get(node) for node in NAMING_NODES])
    try:
        roots = [*HARNESS_SOURCES, *_head_files(name), *named]
    except (ValueError, OSError):  # a bad name or depth: the full check says so
        return None
    for part in parts + [line for root in roots for line in _stats(root)]:
        digest.update(part.encode(errors="replace") + b"\n")
    return digest.hexdigest()


def _candidates(config: dict[str, Any], override_dirname: str) -> list[Path]:
    """The job folders this command line may have named: its experiment's `*-<override hash>`."""
    experiment = config.get("experiment_name")
    if not isinstance(experiment, str) or not experiment or "/" in experiment or experiment in (".", ".."):
        return []
    folder = Path(config.get("results_dir") or "results").resolve() / experiment
    try:
        return sorted(folder.glob(f"*-{override_hash(override_dirname)}"))
    except OSError:
        return []


def finished_by_key(config: dict[str, Any], override_dirname: str) -> Path | None:
    """The finished folder of this job when its key is the one a full check left there; else None."""
    key = finished_key(config, override_dirname)
    if key is None:
        return None
    for job_dir in _candidates(config, override_dirname):
        try:
            saved = (job_dir / FINISHED_KEY).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if saved == key and JobStore(job_dir).skipped_as_finished(overwrite=False):  # the runner's rule
            return job_dir
    return None


def remember(job_dir: Path, config: dict[str, Any], override_dirname: str, device: str) -> None:
    """Leave the key in a job folder the full check found finished under this config's identity
    (`device`: the one the model resolved to). Best effort: a folder that cannot be written keeps
    the slow check."""
    key = finished_key(config, override_dirname)
    if key is None or _device(config) != device.split(":")[0]:
        return
    try:
        write_atomic(job_dir / FINISHED_KEY, key + "\n")
    except OSError:
        pass


def plain_config(cfg: Any) -> dict[str, Any]:
    """A composed config as the key reads it: plain values, interpolations resolved, no `hydra` node
    ({} when it cannot be resolved: no key)."""
    from omegaconf import OmegaConf

    try:
        plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    except Exception:  # an interpolation that does not resolve: the full check reports it
        return {}
    plain.pop("hydra", None)
    return plain
