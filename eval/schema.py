"""The configuration's keys, known without importing torch, and the closest valid key for a key that is
not one.

Hydra's config store needs every method's parameters before it composes a config (`store_configs`),
and the method registry imports every method's module, which imports torch and transformers (about
6 s). The methods' and models' part of the schema (names, each parameter's default and rule) is
therefore the library's, cached under a fingerprint of its sources (`centroidkv.schema`, re-exported
here); this module adds the config's own keys. Unless a source changed (one slow start), a bad key or
value is one line in well under 3 seconds.
"""

from __future__ import annotations

import difflib
from typing import Any

from centroidkv.params import did_you_mean
from centroidkv.schema import (  # noqa: F401  (re-exported: the harness's one door to the schema)
    SCHEMA_VERSION,
    SOURCE_PACKAGES,
    build_schema,
    config_schema,
    fingerprint,
    method_errors,
    schema_path,
    unknown_method_error,
)


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
    for method in schema["methods"].values():
        for key, default in method["params"].items():
            keys.setdefault(f"method.params.{key}", default)
    return keys


LIST_KEYS = ("budgets", "methods")  # null by default in configs/config.yaml, lists when given


def suggestion(key: str, value: str | None, keys: dict[str, Any]) -> str:
    """`did you mean ...?` for a key that is not one: the valid keys whose last part is closest to
    its last part, those under the same node first (`benchmark.n_sample` -> `benchmark.n_samples=1`,
    `budget` -> `budgets=[0.25] or method.budget=0.25`); "" when none is close."""
    node, _, last = key.rpartition(".")
    ratios = {k: difflib.SequenceMatcher(None, last, k.rpartition(".")[2]).ratio() for k in keys if k != key}
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


def missing_param_hint(key: str, schema: dict[str, Any], root: dict[str, Any]) -> str | None:
    """For `method.params.<name>` that the composed method lacks: `snapkv has no parameter x; its
    parameters are ...`, naming the methods that have it (another method's parameter is a valid key
    of the schema, so the closest key would be the key itself); None for any other key."""
    node, _, name = key.rpartition(".")
    method = root.get("method") if isinstance(root.get("method"), dict) else {}
    method_name = method.get("name")
    if node != "method.params" or method_name not in schema["methods"]:
        return None
    params = schema["methods"][method_name]["rules"]
    if name in params:
        return None
    owners = [other for other, entry in schema["methods"].items() if name in entry["rules"]]
    elsewhere = f" ({name} is a parameter of {', '.join(owners)})" if owners else ""
    hint = did_you_mean(name, params)
    return f"{method_name} has no parameter {name}{hint}; its parameters are {', '.join(params)}{elsewhere}"
