"""The configuration's schema, known without importing torch: the model names and every registered
method's parameters with their defaults; and the closest valid key for a key that is not one.

Hydra's config store needs every method's parameters before it composes a config (`store_configs`),
and the method registry imports every method's module, which imports torch and transformers (about
6 s). The schema is therefore kept in `<cache dir>/config_schema.json` (`$CENTROIDKV_CACHE`, else
~/.cache/centroidkv) under a fingerprint of what defines it: the path, size and modification time of
every Python file of the packages that register methods or models (this repository's `centroidkv`
and `baselines`, and each installed plug-in's package), and the plug-ins' versions. Any change there
rebuilds it (one slow start); otherwise a config error is one line in well under 3 seconds.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from centroidkv.model_names import cache_dir
from centroidkv.registry import METHOD_ENTRY_POINTS

SCHEMA_VERSION = 1
SOURCE_PACKAGES = ("centroidkv", "baselines")


def _package_files(package: str) -> list[Path]:
    """The Python files of an importable top-level package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return []
    roots = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
    files = []
    for root in map(Path, roots):
        files += sorted(root.rglob("*.py")) if root.is_dir() else [root]
    return files


def fingerprint() -> str:
    """A hash of everything the schema is derived from (see the module's docstring)."""
    packages = set(SOURCE_PACKAGES)
    plugins = []
    for entry_point in metadata.entry_points(group=METHOD_ENTRY_POINTS):
        packages.add(entry_point.value.split(":")[0].split(".")[0])
        distribution = getattr(entry_point, "dist", None)
        plugins.append(f"{entry_point.value}@{distribution.version if distribution else ''}")
    digest = hashlib.sha256(f"{SCHEMA_VERSION}|{sorted(plugins)}".encode())
    for package in sorted(packages):
        for path in _package_files(package):
            stat = path.stat()
            digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def build_schema() -> dict[str, Any]:
    """The schema from the registries themselves (imports every method: slow)."""
    from centroidkv import get_method, method_names
    from centroidkv.models import MODEL_NAMES

    return {
        "models": list(MODEL_NAMES),
        "methods": {name: get_method(name).params() for name in method_names()},
    }


def schema_path() -> Path:
    return cache_dir() / "config_schema.json"


def config_schema() -> dict[str, Any]:
    """The schema, from its cache when the fingerprint matches, else built and cached again (a cache
    that cannot be written is only slower). A process that has imported the method registry already
    reads it directly and writes no cache: it may hold methods registered at run time (a test's, a
    notebook's), which the next process would not have."""
    if "centroidkv.methods" in sys.modules:
        return build_schema()
    key = fingerprint()
    path = schema_path()
    try:
        cached = json.loads(path.read_text())
        if cached.get("fingerprint") == key:
            return cached["schema"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    schema = build_schema()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"fingerprint": key, "schema": schema}, default=str))
        os.replace(temporary, path)
    except OSError:
        pass
    return schema


def known_keys(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """Every valid dotted key of a run's config with an example value: the root config's keys, the
    model's, each method's parameters under `method.params.`, and the composed benchmark's (`root` maps a
    node to its keys and defaults)."""
    keys: dict[str, Any] = {}
    for node, value in root.items():
        keys[node] = value
        if isinstance(value, dict):
            for key, default in value.items():
                keys[f"{node}.{key}"] = default
    for params in schema["methods"].values():
        for key, default in params.items():
            keys.setdefault(f"method.params.{key}", default)
    return keys


LIST_KEYS = ("budgets", "methods")  # null by default in configs/config.yaml, lists when given


def suggestion(key: str, value: str | None, keys: dict[str, Any]) -> str:
    """`did you mean ...?` for a key that is not one: the valid keys whose last part is closest to
    its last part, those under the same node first (`benchmark.n_sample` -> `benchmark.n_samples=1`,
    `budget` -> `budgets=[0.25] or method.budget=0.25`); "" when none is close."""
    node, _, last = key.rpartition(".")
    ratios = {k: difflib.SequenceMatcher(None, last, k.rpartition(".")[2]).ratio() for k in keys}
    close = sorted(
        (k for k, ratio in ratios.items() if ratio >= 0.8),
        key=lambda k: (k.rpartition(".")[0] != node, -ratios[k], k),
    )[:2]
    if not close:
        return ""

    def written(name: str) -> str:
        if value is None:
            return name
        as_list = (name in LIST_KEYS or isinstance(keys[name], (list, tuple))) and not value.startswith("[")
        return f"{name}=[{value}]" if as_list else f"{name}={value}"

    return f"did you mean {' or '.join(written(k) for k in close)}?"
