"""CentroidKV: KV cache clustering with Chunked Soft Matching, and the cache it runs in.

The public names below are imported on first use (module `__getattr__`), so that importing a light
submodule (e.g. `centroidkv.calibrate` for `python -m eval.calibrate --help`) does not pay for torch
and transformers.
`from centroidkv import CompressedCache, get_method, load_model` works as with eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the submodule that defines it.
_EXPORTS = {
    "ATTN_IMPLEMENTATION": "centroidkv.attention",
    "prepare_model": "centroidkv.attention",
    "CompressedCache": "centroidkv.cache.cache",
    "LayerKV": "centroidkv.kv",
    "LayerStats": "centroidkv.kv",
    "Method": "centroidkv.methods",
    "get_method": "centroidkv.methods",
    "method_names": "centroidkv.methods",
    "register": "centroidkv.methods",
    "load_model": "centroidkv.models.loading",
    "load_tokenizer": "centroidkv.models.loading",
}

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CompressedCache",
    "LayerKV",
    "LayerStats",
    "Method",
    "get_method",
    "load_model",
    "load_tokenizer",
    "method_names",
    "prepare_model",
    "register",
]

if TYPE_CHECKING:  # for type checkers and editors: the eager imports
    from centroidkv.attention import ATTN_IMPLEMENTATION, prepare_model
    from centroidkv.cache.cache import CompressedCache
    from centroidkv.kv import LayerKV, LayerStats
    from centroidkv.methods import Method, get_method, method_names, register
    from centroidkv.models.loading import load_model, load_tokenizer


def __getattr__(name: str) -> Any:
    """Import the submodule defining a public name on first access, and keep the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'centroidkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
