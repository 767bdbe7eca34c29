"""The storage precision: how the cache stores a method's keys and values, a wrapper around any method
(`centroidkv.wrapper`; the codes themselves: `centroidkv.cache.quantization`).

Parameters (every method takes them; `get_method("snapkv", kv_precision="int4")`):
  kv_precision: "model" (the model's dtype, nothing converted: the default), "bf16", "fp16", or KIVI's
    integer codes "int8" / "int4" / "int2" (`centroidkv.cache.quantization.PRECISIONS`).
  kv_group: tokens (keys) or channels (values) per group of integer codes, a power of two that
    divides the head size (KIVI: 32).
  kv_residual: the newest tokens kept in the model's dtype until a whole group can be coded (KIVI: 128).
In the model's dtype a run records none of them (`recorded`), so the runs of the days before any
precision keep their identity; otherwise its label names the precision (" @int8") and so does its
default variant name ("-int8"). A method sets them apart in its class's `wrapper_params` (KIVI:
int2 or int4 only; kvpress: the model's dtype only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from centroidkv.cache.quantization import (
    DEFAULT_GROUP,
    DEFAULT_RESIDUAL,
    GROUP_RULE,
    PRECISIONS,
    RESIDUAL_RULE,
    StorageFormat,
)
from centroidkv.params import param
from centroidkv.wrapper import MethodWrapper, register_wrapper

OWN_DTYPE = ("model", None)  # a run's kv_precision when its entries stay in the model's dtype


def precision_suffix(params: dict[str, Any]) -> str:
    """What a run's label adds for its storage precision (" @int8"); nothing in the model's dtype."""
    precision = params.get("kv_precision", "model")
    return "" if precision in OWN_DTYPE else f" @{precision}"


@register_wrapper
@dataclass
class StoragePrecision(MethodWrapper):
    """A method whose cache stores its keys and values at `kv_precision` (module docstring)."""

    depth = 10  # inside the head policy: its parameters come after the policy's in a record

    kv_precision: str = param("model", choices=PRECISIONS)
    kv_group: int = param(DEFAULT_GROUP, **GROUP_RULE)
    kv_residual: int = param(DEFAULT_RESIDUAL, **RESIDUAL_RULE)

    @property
    def storage(self) -> StorageFormat:
        """How the cache stores the method's keys and values."""
        return StorageFormat(self.kv_precision, self.kv_group, self.kv_residual)

    @classmethod
    def recorded(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Nothing in the model's dtype (module docstring), else every parameter."""
        return {} if values.get("kv_precision") == "model" else values

    @classmethod
    def label_suffix(cls, params: dict[str, Any]) -> str:
        return precision_suffix(params)

    @classmethod
    def variant_suffix(cls, params: dict[str, Any]) -> str:
        precision = params.get("kv_precision", "model")
        return "" if precision in OWN_DTYPE else f"-{precision}"
