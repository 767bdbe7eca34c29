"""Running prompts: one plan per prompt (`plan`), prefill and decoding (`decoding`), their timing,
the measurements every run records, the prefill store, and the options that configure them.

`run` and `warm_up` (`centroidkv.plan.plan`) are importable from here, on first use (module
`__getattr__`): importing a light submodule (`centroidkv.plan.run_options`) pays for no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"run": "centroidkv.plan.plan", "warm_up": "centroidkv.plan.plan"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the submodule defining a public name on first access, and keep the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'centroidkv.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
