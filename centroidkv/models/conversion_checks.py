"""What a converted checkpoint must be to be loaded: every file its manifest (conversion.json, written
last by the conversion) names, at the size it wrote, the small files unchanged, a wheel model's
config.json of the declared shape, and tokenizer files of the current layout
(`centroidkv.models.tokenizer_files`)."""

from __future__ import annotations

import json
from pathlib import Path

from centroidkv.errors import first_line
from centroidkv.models.tokenizer_files import TOKENIZER_LAYOUT
from centroidkv.models.wheel_models import WheelModel, file_sha256

# Written last into a converted checkpoint: the size of every file, checked before each load.
MANIFEST = "conversion.json"
# What a converted checkpoint holds at least (one converted before the manifest has no manifest).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def write_manifest(folder: Path, gguf_name: str) -> None:
    """`folder`'s manifest: each file's size, each small file's SHA-256, the tokenizer layout."""
    files = sorted(path for path in folder.iterdir() if path.is_file() and path.name != MANIFEST)
    manifest = {
        "gguf": gguf_name,
        "files": {path.name: path.stat().st_size for path in files},
        "sha256": {path.name: file_sha256([path]) for path in files if path.suffix != ".safetensors"},
        "tokenizer_layout": TOKENIZER_LAYOUT,
    }
    partial = folder / f".{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(folder / MANIFEST)


def read_manifest(folder: Path) -> dict:
    """`folder`'s manifest ({} when it has none or it cannot be read)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def tokenizer_outdated(folder: Path) -> bool:
    """Whether a complete checkpoint's tokenizer files were written before the current layout."""
    return read_manifest(folder).get("tokenizer_layout") != TOKENIZER_LAYOUT


def conversion_problem(folder: Path, wheel: WheelModel | None = None) -> str | None:
    """What is wrong with a converted checkpoint, or None when it is complete: missing, a file missing
    or of the wrong size, a small file (all but the weights) changed since the conversion wrote it, or
    a wheel model's config.json saying other than the model declares (`wheel_config_problem`).
    Without a manifest (converted by an older version) the safetensors file must have the size its own
    header describes."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        sizes = manifest["files"] if isinstance(manifest, dict) else None
        if not isinstance(sizes, dict):
            raise ValueError("no file sizes")
    except FileNotFoundError:
        sizes = manifest = None
    except (OSError, ValueError, KeyError) as error:
        return f"its {MANIFEST} cannot be read ({first_line(error)})"
    if sizes is None:
        missing = [name for name in CONVERTED_FILES if not (folder / name).is_file()]
        if missing:
            return "not converted yet" if not folder.exists() else f"{', '.join(missing)} missing"
        problem = _safetensors_problem(folder / "model.safetensors")
    else:
        problem = _manifest_problem(folder, sizes, manifest.get("sha256") or {})
    return problem or (wheel_config_problem(folder / "config.json", wheel) if wheel else None)


def _manifest_problem(folder: Path, sizes: dict, hashes: dict) -> str | None:
    """A file of the manifest missing, of another size or (the small ones) of another SHA-256."""
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the conversion wrote {size}"
        if name in hashes and file_sha256([path]) != hashes[name]:
            return f"{name} changed since the conversion wrote it"
    return None


def wheel_config_problem(config_file: Path, wheel: WheelModel) -> str | None:
    """Where a wheel model's converted config.json says other than the model declares (its layers,
    query and KV heads, positions), or None."""
    try:
        config = json.loads(config_file.read_text())
        config = config.get("text_config", config) if isinstance(config, dict) else {}
    except (OSError, ValueError) as error:
        return f"{config_file.name} cannot be read ({first_line(error)})"
    wrong = [
        f"{key} {config.get(key)} (not {value})"
        for key, value in wheel.declared_config.items()
        if config.get(key) != value
    ]
    return f"{config_file.name} says {', '.join(wrong)}" if wrong else None


def _safetensors_problem(path: Path) -> str | None:
    """Whether a safetensors file is as long as its header says (8 bytes of header length, the JSON
    header, then the tensors' data up to the largest end offset): a truncated file is not."""
    try:
        with path.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
        end = max(
            (entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        return f"{path.name} cannot be read ({first_line(error)})"
    expected = 8 + header_size + end
    actual = path.stat().st_size
    return None if actual == expected else f"{path.name} has {actual} bytes, its header describes {expected}"
