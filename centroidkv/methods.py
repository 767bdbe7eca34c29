"""The one interface every compression method implements, and the registry of methods by name.

A method sees one layer's *mergeable segment* (the cache without its protected sinks and recent
window) and shrinks it to `target_len` tokens. The cache decides when to call it and what the budget
is; methods only decide which tokens survive (eviction) or how they combine (merging).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import ClassVar

from centroidkv.kv import LayerKV, LayerStats
from centroidkv.needs import Need, gather_needs

__all__ = ["LayerKV", "LayerStats", "Method", "Need", "check_float", "get_method", "method_names", "register"]


@dataclass
class Method:
    """Base class: shared parameters and their validation.

    Parameters common to every method:
      n_sink: first tokens never compressed (attention sinks).
      n_recent: last tokens never compressed (recent window).
      compress_interval: g, decoding re-compresses when the cache reaches budget + g.
    Subclasses declare their own parameters as dataclass fields with their paper's defaults and
    extend `validate`.
    """

    name: ClassVar[str] = "base"
    compresses: ClassVar[bool] = True  # False for the full cache
    merges: ClassVar[bool] = False  # True when log_degree changes (CentroidKV, K-Means, CaM)

    n_sink: int = 16
    n_recent: int = 64
    compress_interval: int = 64

    def __post_init__(self) -> None:
        self.validate()

    def needs(self) -> tuple[Need, ...]:
        """What the cache must record for this method (`centroidkv.needs`): none by default."""
        return ()

    @property
    def query_window(self) -> int:
        """How many of the latest query states `LayerStats.queries` must hold (0: none)."""
        return gather_needs(self.needs()).get("queries", 0)

    def check_model(self, model_name: str) -> None:
        """Raise ValueError when this method's parameters cannot run on `model_name` (checked by the
        runner's config validation, before any model loads). Nothing to check by default."""

    def kept_whole(self, model) -> dict[int, list[int]]:
        """KV heads, per layer index, that keep every entry and are never compressed (CentroidKV's
        outlier heads); called once when a cache first compresses on `model`. None by default."""
        return {}

    def validate(self) -> None:
        _check_int(self, "n_sink", minimum=0)
        _check_int(self, "n_recent", minimum=0)
        _check_int(self, "compress_interval", minimum=1)

    def layer_budget(self, budget_len: int, layer_idx: int, n_layers: int) -> int:
        """Tokens this layer may keep; methods with per-layer budgets (PyramidKV) override it."""
        return budget_len

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        """Shrink the mergeable segment `kv` to exactly `target_len` tokens."""
        raise NotImplementedError

    def params(self) -> dict:
        return dataclasses.asdict(self)


def _check_int(method: Method, field: str, minimum: int) -> None:
    value = getattr(method, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{method.name}: {field} must be an integer >= {minimum}, got {value!r}")


def check_float(method: Method, field: str, low: float, high: float, low_open: bool = False) -> None:
    """Raise one clear ValueError unless `low <= value <= high` (or `low < value` when low_open)."""
    value = getattr(method, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{method.name}: {field} must be a number in {bracket}{low}, {high}], got {value!r}")


REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available to `get_method(cls.name)`."""
    REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    # Methods register themselves on import; baselines live in their own top-level package.
    importlib.import_module("centroidkv.method")
    importlib.import_module("baselines")


def method_names() -> list[str]:
    _load_all()
    return list(REGISTRY)


def get_method(name: str, **params) -> Method:
    """Build a registered method with keyword parameters; unknown names and parameters raise ValueError."""
    _load_all()
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**params)
