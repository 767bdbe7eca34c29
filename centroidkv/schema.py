"""The methods' and models' schema, known without importing torch: the model names, and each registered
method's parameters with their defaults and rules (`centroidkv.params`) and its shorthand parameter;
and the torch-free checks built on it (`check_method_spec`, `method_spec_errors`).

The method registry imports every method's module, which imports torch and transformers (about 6 s),
so the schema is kept in `<cache dir>/config_schema.json` (`$CENTROIDKV_CACHE`, else
~/.cache/centroidkv) under a fingerprint of what defines it: the path, size and modification time of
every Python file of the library and of each package declared under the methods' entry-point group
(`centroidkv.registry.METHOD_ENTRY_POINTS`), those distributions' versions, and the installed
distributions (a rule may list a library's names: kvpress's presses). Any change there
rebuilds it (one slow start); otherwise a bad method or value is one line in well under a second.
The harness's configuration (`eval.schema`) reads the same schema.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from centroidkv.files import write_atomic
from centroidkv.models.model_names import MODEL_NAMES, cache_dir
from centroidkv.params import did_you_mean, param_errors
from centroidkv.parsing import parse_method_spec, shorthand_error
from centroidkv.registry import METHOD_ENTRY_POINTS

SCHEMA_VERSION = 2  # 2: per method {params, rules, shorthand} (1: the parameters' defaults only)
SOURCE_PACKAGES = ("centroidkv",)  # the packages declared under METHOD_ENTRY_POINTS come on top


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


def _installed_distributions() -> list[str]:
    """The names of the installed distributions' metadata folders (`kvpress-0.5.5.dist-info`): they
    change when a package is installed, removed or upgraded (a method's rules may read a library:
    kvpress's press names)."""
    names = []
    for entry in map(Path, sys.path):
        if entry.is_dir():
            names += [p.name for p in entry.iterdir() if p.suffix in (".dist-info", ".egg-info")]
    return sorted(names)


def fingerprint() -> str:
    """A hash of everything the schema is derived from (see the module's docstring)."""
    packages = set(SOURCE_PACKAGES)
    plugins = []
    for entry_point in metadata.entry_points(group=METHOD_ENTRY_POINTS):
        packages.add(entry_point.value.split(":")[0].split(".")[0])
        distribution = getattr(entry_point, "dist", None)
        plugins.append(f"{entry_point.value}@{distribution.version if distribution else ''}")
    digest = hashlib.sha256(f"{SCHEMA_VERSION}|{sorted(plugins)}|{_installed_distributions()}".encode())
    for package in sorted(packages):
        for path in _package_files(package):
            stat = path.stat()
            digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def build_schema() -> dict[str, Any]:
    """The schema from the registries themselves (imports every method's module: slow; builds none).
    Per method: `params`, its default parameters as a run records them (`Method.default_params`:
    Hydra's `method=<name>` node); `rules`, every parameter (the storage ones too) with its default
    and rule (`Method.rules`); `shorthand`, the parameter that `name:value` sets
    (None: no such form); `compresses`, False for the full cache."""
    from centroidkv.methods import method_class, method_names

    methods = {}
    for name in method_names():
        cls = method_class(name)
        methods[name] = {
            "params": cls.default_params(),
            "rules": cls.rules(),
            "shorthand": cls.shorthand,
            "compresses": cls.compresses,
        }
    return {"models": list(MODEL_NAMES), "methods": methods}


def is_schema(schema: Any) -> bool:
    """Whether `schema` has the shape `build_schema` gives: a cached file that parses, with the right
    fingerprint, but not this shape (emptied, edited by hand) is rebuilt rather than trusted."""
    if not isinstance(schema, dict) or not isinstance(schema.get("models"), list):
        return False
    methods = schema.get("methods")
    if not isinstance(methods, dict) or not methods:
        return False
    return all(
        isinstance(entry, dict)
        and isinstance(entry.get("params"), dict)
        and isinstance(entry.get("rules"), dict)
        and all(isinstance(rule, dict) for rule in entry["rules"].values())
        and "shorthand" in entry
        and (entry["shorthand"] is None or isinstance(entry["shorthand"], str))
        for entry in methods.values()
    )


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
    schema = cached_schema(key)
    if schema is not None:
        return schema
    schema = build_schema()
    try:
        path = schema_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"fingerprint": key, "schema": schema}, default=str))
    except OSError:
        pass
    return schema


def cached_schema(key: str | None = None) -> dict[str, Any] | None:
    """The cached schema when it is current (its fingerprint is `key`, default: today's), else None;
    never builds it (so never imports torch): what a command's `--help` can show at once."""
    try:
        cached = json.loads(schema_path().read_text())
        if cached.get("fingerprint") == (key or fingerprint()) and is_schema(cached["schema"]):
            return cached["schema"]
    except (OSError, ValueError, AttributeError, KeyError):
        pass
    return None


def unknown_method_error(name: Any, schema: dict[str, Any]) -> str:
    """The line for a method name that is not registered, naming the closest registered one."""
    names = list(schema["methods"])
    return f"unknown method {name!r}; choose one of {', '.join(names)}{did_you_mean(name, names)}"


def method_errors(name: str, params: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """One line per given parameter of the registered method `name` that it lacks (one line for all
    of them: `centroidkv.params.param_errors`) or whose value breaks its rule (a bound by another
    parameter included: r_min <= r_init). What reads a file or builds an object (a head file, a
    press's own parameters) is left to the method's own `validate`."""
    return param_errors(name, params, schema["methods"][name]["rules"])


def method_spec_errors(spec: str, schema: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with a method's command-line form (`name`, `name:value`, `name(key=value, ...)`,
    read as `centroidkv.methods.parse_method` reads it), without importing torch: one line per problem
    (an unknown method or parameter with the closest known one, a value against its rule)."""
    try:
        name, short, params = parse_method_spec(spec)
    except ValueError as error:
        return [str(error)]
    schema = config_schema() if schema is None else schema
    if name not in schema["methods"]:
        return [unknown_method_error(name, schema)]
    if short is not None:
        field_name = schema["methods"][name]["shorthand"]
        if field_name is None:
            return [shorthand_error(spec, name)]
        params = {field_name: short, **params}
    return method_errors(name, params, schema)


def check_method_spec(spec: str, schema: dict[str, Any] | None = None) -> None:
    """Raise one ValueError line (the first of `method_spec_errors`) unless `spec` names a registered
    method with parameters it has and values its rules accept; fast: torch is not imported. Whatever
    needs the method object (a head file, a press's own parameters) is checked when `parse_method`
    builds it."""
    errors = method_spec_errors(spec, schema)
    if errors:
        raise ValueError(errors[0])
