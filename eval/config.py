"""Typed run configuration: the composed Hydra config validated into dataclasses before anything loads.

`build_run_config(cfg, job)` checks every value and raises `ConfigError` with one line per bad value,
so `scripts/run.py` can print them and exit without loading a model or writing a file. It checks in
two passes. The first (`first_pass_errors`) needs no torch: keys, budgets, model name and syntax,
method names and each given parameter's name and value against the rules the methods declare (read
from the cached schema, `centroidkv.schema`), benchmark, logger, experiment name, flags, decode batch
and budget unit, each with the closest valid key or value where one exists; when it finds anything,
its lines are raised at once (in well under 3 seconds). Only then does the second build the methods
(imports torch) for what needs them: head files, a press's own parameters, CUDA, budgets that keep
nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from centroidkv.cache.budget import (
    DEFAULT_BUDGET_UNIT,
    budget_entries,
    check_budget,
    check_budget_unit,
    fit_protected,
)
from centroidkv.errors import first_line
from centroidkv.head_policy import HeadPolicy, compressed_fraction
from centroidkv.models.model_names import declared_positions
from centroidkv.params import did_you_mean
from centroidkv.plan.run_options import DEFAULT_DECODE_BATCH, check_decode_batch
from eval.benchmarks import Benchmark, benchmark_names, build_benchmark
from eval.records import NAME_MAX
from eval.run_config import ConfigError, LoggerConfig, MethodSpec, ModelConfig, PrefillStoreConfig, RunConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# The keys a composed config may hold (Hydra's `+key=value` can add any other: those are errors).
ROOT_KEYS = ("model", "method", "methods", "budgets", "budget_unit", "benchmark", "logger", "experiment_name",
             "results_dir", "retry_failed", "warmup", "overwrite", "share_prefill", "decode_batch", "workers",
             "kv_precision", "prefill_store")  # fmt: skip
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))
METHOD_KEYS = ("name", "budget", "params")  # a method's node: its name, R and its parameters
LOGGER_KEYS = tuple(f.name for f in fields(LoggerConfig))


DEFAULT_BUDGET = (
    0.5  # `method.budget` of every method's config: R, the cache ratio of (prompt + max new tokens)
)


def store_configs() -> None:
    """Register Hydra's `model/<name>`, `method/<name>` and `benchmark/<name>` options, built from
    the registries.

    Each model of `centroidkv.models.loading.MODEL_NAMES` becomes `model=<name>` (dtype and device null: the
    defaults of `centroidkv.models.loading`); each registered method (the library's, one module in
    `baselines/`, or from an entry point) becomes `method=<name>` with `params` = its dataclass
    defaults, the only place defaults live, and `budget` = DEFAULT_BUDGET; each benchmark of
    `eval.benchmarks` becomes `benchmark=<name>` with its dataclass defaults. Call before Hydra
    composes (scripts/run.py does at startup). Names and defaults come through `eval.schema`, cached, so
    that a config error is one line without importing torch.
    """
    from hydra.core.config_store import ConfigStore

    from eval.schema import config_schema

    schema = config_schema()  # the registries' names and defaults, cached: torch is not imported
    share_store_on_copy()
    store = ConfigStore.instance()
    registered = {
        "model": schema["models"],
        "method": list(schema["methods"]),
        "benchmark": benchmark_names(),
    }
    for group, names in registered.items():  # forget options whose method or benchmark is gone
        options = store.repo.get(group, {})
        for option in [o for o, node in options.items() if node.provider == "centroidkv"]:
            if option.removesuffix(".yaml") not in names:
                del options[option]
    for name in registered["model"]:
        node = {"name": name, "dtype": None, "device": None}
        store.store(group="model", name=name, node=node, provider="centroidkv")
    for name in registered["method"]:
        node = {"name": name, "budget": DEFAULT_BUDGET, "params": schema["methods"][name]["params"]}
        store.store(group="method", name=name, node=node, provider="centroidkv")
    for name in registered["benchmark"]:
        node = build_benchmark({"name": name})[0].params()
        store.store(group="benchmark", name=name, node=node, provider="centroidkv")


def share_store_on_copy() -> None:
    """Hydra deep-copies its config repository once per config group it lists or composes, and with
    it the ConfigStore singleton, every method's node included (`run.py --help`: 75 copies, over a
    second). The copy keeps the repository's list of sources apart; the store is only read through it
    (`ConfigStore.load` returns a copy of a node), so every copy shares the one store."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.__deepcopy__ = lambda self, memo: self


METHOD_ENTRY_KEYS = ("name", "variant", "params", "samples")


def _method_entry(
    entry: Any, method_raw: dict[str, Any], errors: list[str], names: list[str]
) -> tuple[str, str, dict[str, Any], Any] | None:
    """(method name, variant, parameters given, sample cap) of one `methods` entry, or None after an
    error line.

    An entry is a registered name (of `names`: the schema's), or a mapping {name, variant, params,
    samples} (`samples`: `MethodSpec.samples`, checked by `sample_cap_error`).
    The parameters given are `method.params` when `method.name` is this method, then the entry's own
    `params`; the method's dataclass supplies every other default.
    """
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - set(METHOD_ENTRY_KEYS))
        if unknown:
            errors.append(
                f"methods: unknown key(s) {', '.join(unknown)} in {entry}; an entry holds "
                f"{', '.join(METHOD_ENTRY_KEYS)}"
            )
            return None
        name, variant, own = entry.get("name"), entry.get("variant"), entry.get("params")
        if (problem := sample_cap_error(entry.get("samples"))) is not None:
            errors.append(f"methods: samples of {variant or name}: {problem}")
            return None
    else:
        name, variant, own = entry, None, None
    if name not in names:
        errors.append(
            f"methods: unknown method {name!r}; registered: {', '.join(names)}{did_you_mean(name, names)}"
        )
        return None
    if variant is not None and (
        not isinstance(variant, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", variant)
    ):
        errors.append(f"methods: variant must be a plain name (letters, digits, _ . + -), got {variant!r}")
        return None
    if own is not None and not isinstance(own, dict):
        errors.append(f"methods: params of {variant} must be a mapping, got {own!r}")
        return None
    params = dict(method_raw.get("params") or {}) if method_raw.get("name") == name else {}
    params.update(own or {})
    return str(name), variant, params, entry.get("samples") if isinstance(entry, dict) else None


def sample_cap_error(samples: Any) -> str | None:
    """What is wrong with a method entry's `samples` (None: nothing): absent, a count >= 1, or a
    mapping {context length: count >= 1}."""
    counts = samples.values() if isinstance(samples, dict) else [] if samples is None else [samples]
    keys = samples.keys() if isinstance(samples, dict) else []
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in [*counts, *keys]):
        return f"a count >= 1 or a mapping {{length: count >= 1}}, got {samples!r}"
    return None


def _check_budget(value: Any, where: str, errors: list[str]) -> float | None:
    try:
        return check_budget(value)
    except ValueError as error:
        errors.append(f"{where}: {error}")
        return None


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


@dataclass
class _FirstPass:
    """What the first pass read from a config, for the second (`build_run_config`)."""

    model: ModelConfig
    entries: list[tuple[str, str | None, dict[str, Any], Any]]  # (method, variant, parameters, cap)
    budgets: list[float]
    benchmark: Benchmark | None
    logger: LoggerConfig
    experiment: Any
    decode_batch: Any
    budget_unit: Any


def _plain(cfg: DictConfig | dict) -> dict[str, Any]:
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    raw.pop("hydra", None)
    return raw


def _method_line(variant: str | None, name: str, line: str) -> str:
    """A method's error line, naming it once (its own messages begin with its name) and its variant."""
    label = name if variant in (None, name) else f"{variant} ({name})"
    return f"method {label}: {line.removeprefix(f'{name}: ')}"


def first_pass_errors(cfg: DictConfig | dict, schema: dict[str, Any] | None = None) -> list[str]:
    """One line per bad value that can be found without torch (the module's docstring); [] when the
    config may go on to the second pass. `schema`: `centroidkv.schema.config_schema()` by default."""
    return _first_pass(_plain(cfg), schema)[1]


def _first_pass(raw: dict[str, Any], schema: dict[str, Any] | None) -> tuple[_FirstPass, list[str]]:
    from eval.schema import config_schema

    schema = config_schema() if schema is None else schema
    errors: list[str] = []
    errors.extend(_unknown_keys(raw, ROOT_KEYS, ""))
    for node, keys in (("model", MODEL_KEYS), ("method", METHOD_KEYS), ("logger", LOGGER_KEYS)):
        if isinstance(raw.get(node), dict):
            errors.extend(_unknown_keys(raw[node], keys, f"{node}."))

    model, model_errors = ModelConfig.parse(raw.get("model") or {})
    errors.extend(model_errors)
    entries, budgets = _methods_and_budgets(raw, schema, errors)
    benchmark, benchmark_errors = build_benchmark(dict(raw.get("benchmark") or {}))
    errors.extend(benchmark_errors)
    if not model_errors and not benchmark_errors:
        errors.extend(_positions_errors(model.name, benchmark))
    logger, logger_errors = LoggerConfig.parse(raw.get("logger") or {"name": "none"})
    errors.extend(logger_errors)
    experiment = raw.get("experiment_name")
    errors.extend(_experiment_name_errors(experiment))
    errors.extend(_run_option_errors(raw))
    decode_batch = raw.get("decode_batch", DEFAULT_DECODE_BATCH)
    budget_unit = raw.get("budget_unit", DEFAULT_BUDGET_UNIT)
    read = _FirstPass(model, entries, budgets, benchmark, logger, experiment, decode_batch, budget_unit)
    return read, errors


def _methods_and_budgets(
    raw: dict[str, Any], schema: dict[str, Any], errors: list[str]
) -> tuple[list[tuple[str, str, dict[str, Any]]], list[float]]:
    """The method entries (name, variant, params, sample cap) and budgets of a run; what is wrong goes
    to `errors`."""
    from eval.schema import method_errors

    method_raw = raw.get("method") or {}
    method_entries = _as_list(raw.get("methods")) or [method_raw.get("name")]
    budgets_raw = _as_list(raw.get("budgets")) or _as_list(method_raw.get("budget"))
    if not budgets_raw:
        errors.append("budgets: at least one budget is needed (method.budget or budgets)")
    budgets = [b for b in (_check_budget(v, "budgets", errors) for v in budgets_raw) if b is not None]
    if len(set(budgets)) != len(budgets):
        errors.append(f"budgets: duplicates in {budgets_raw}")
    entries = []
    for entry in method_entries:
        parsed = _method_entry(entry, method_raw, errors, list(schema["methods"]))
        if parsed is None:
            continue
        name, variant, params, samples = parsed
        if raw.get("kv_precision") is not None:  # the run's storage precision, unless the entry sets one
            params.setdefault("kv_precision", raw["kv_precision"])
        errors.extend(_method_line(variant, name, line) for line in method_errors(name, params, schema))
        entries.append((name, variant, params, samples))
    return entries, budgets


def _experiment_name_errors(experiment: Any) -> list[str]:
    """experiment_name must be a plain folder name that fits the file system."""
    if (
        not isinstance(experiment, str)
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", experiment)
        or experiment in (".", "..")  # the results folder itself, or the folder above it
    ):
        return [
            "experiment_name: must be a plain folder name (letters, digits, _ . -; not . or ..), "
            f"got {experiment!r}"
        ]
    if len(experiment) > NAME_MAX:  # ASCII by the pattern: one byte per character
        return [
            f"experiment_name: {len(experiment)} characters, more than a folder name may have ({NAME_MAX})"
        ]
    return []


def _run_option_errors(raw: dict[str, Any]) -> list[str]:
    """The run's switches are booleans; decode_batch, budget_unit and prefill_store pass their own checks."""
    errors = [
        f"{key}: must be true or false, got {raw.get(key)!r}"
        for key in ("retry_failed", "warmup", "overwrite", "share_prefill")
        if not isinstance(raw.get(key, False), bool)
    ]
    workers = raw.get("workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        errors.append(f"workers: must be an integer >= 1 (processes, one per core), got {workers!r}")
    checks = (
        (check_decode_batch, raw.get("decode_batch", DEFAULT_DECODE_BATCH)),
        (check_budget_unit, raw.get("budget_unit", DEFAULT_BUDGET_UNIT)),
    )
    for check, value in checks:
        try:
            check(value)
        except ValueError as error:
            errors.append(str(error))
    return errors + PrefillStoreConfig.parse(raw.get("prefill_store"))[1]


def build_run_config(
    cfg: DictConfig | dict, job: str = "default", schema: dict[str, Any] | None = None
) -> RunConfig:
    """Validate a composed config; raise ConfigError (one line per bad value) or return a RunConfig
    of the job `job` (the command line names it from its overrides: `named_job`). The first pass
    (`first_pass_errors`, without torch; `schema` as there) raises on its own when it finds anything;
    then the methods are built, which imports torch."""
    raw = _plain(cfg)
    read, errors = _first_pass(raw, schema)
    if errors:
        raise ConfigError(errors)
    from centroidkv import get_method
    from centroidkv.methods import method_variant

    model, benchmark, budget_unit = read.model, read.benchmark, read.budget_unit
    model_name = model.name
    errors.extend(model.device_errors())
    specs: list[MethodSpec] = []
    variants: list[str] = []
    for name, variant, params, samples in read.entries:
        try:
            method = get_method(name, **params)
            method.check_model(str(model_name))
        except (ValueError, TypeError) as error:
            errors.append(_method_line(variant, name, first_line(error)))
            continue
        params = method.params()  # the full effective parameters, defaults included
        variant = variant or method_variant(name, params)  # e.g. kvpress-TOVA, centroidkv-int8
        if variant in variants:
            errors.append(
                f"methods: {variant!r} appears twice; give each entry of one method its own `variant`"
            )
            continue
        variants.append(variant)
        if not method.compresses:  # the full cache is one reference run, whatever the budgets
            specs.append(MethodSpec(name, 1.0, params, variant, samples))
            continue
        specs.extend(MethodSpec(name, b, params, variant, samples) for b in read.budgets)
    if not errors:
        errors.extend(_budget_errors(specs, benchmark, str(model_name), budget_unit, model.resolved()[1]))
    if errors:
        raise ConfigError(errors)
    job_dir = Path(raw.get("results_dir") or "results").resolve() / read.experiment / job
    return RunConfig(
        experiment=read.experiment,
        job=job,
        job_dir=job_dir,
        model=model,
        methods=tuple(specs),
        benchmark=benchmark,
        logger=read.logger,
        budget_unit=budget_unit,
        retry_failed=bool(raw.get("retry_failed", False)),
        warmup=bool(raw.get("warmup", True)),
        overwrite=bool(raw.get("overwrite", False)),
        share_prefill=bool(raw.get("share_prefill", True)),
        decode_batch=read.decode_batch,
        workers=int(raw.get("workers", 1)),
        prefill_store=PrefillStoreConfig.parse(raw.get("prefill_store"))[0],
    )


def _positions_errors(model_name: str, benchmark: Benchmark) -> list[str]:
    """A line when a length (prompt and new tokens, RULER and NIAH) exceeds the model's positions,
    where they are known without torch (`centroidkv.models.model_names.declared_positions`)."""
    positions = declared_positions(model_name)
    if positions is None or not benchmark.length_is_tokens:
        return []
    over = [length for length in benchmark.lengths if isinstance(length, int) and length > positions]
    return [
        f"benchmark.lengths: {length} tokens (prompt and new tokens) exceed {model_name}'s {positions} "
        "positions"
        for length in over
    ]


def _unknown_keys(node: dict[str, Any], known: tuple[str, ...], prefix: str) -> list[str]:
    return [
        f"{prefix}{key}: unknown key; {prefix.rstrip('.') or 'the config'} holds {', '.join(known)}"
        for key in node
        if key not in known
    ]


# heads=budget listing every head: none is compressed to B, each keeps heads_boost x B = R x its
# length, so B = R x length / heads_boost rounds to 0 entries below heads_boost / R tokens.
EVERY_HEAD_FAVOURED = (
    "heads=budget lists every KV head (heads_fraction), so no head is compressed and each keeps R / heads_boost "
    "of its length boosted back: at best heads=none, and nothing at all on prompts under heads_boost / R tokens; "
    "lower heads_fraction or use heads=none"
)


def _budget_errors(
    specs: list[MethodSpec], benchmark: Benchmark, model_name: str, budget_unit: str, dtype: str = "float32"
) -> list[str]:
    """One line per (variant, budget) that cannot run, found before any model loads:
    - in bytes, heads the method keeps whole (CentroidKV's outlier heads) that alone take the budget;
    - a budget that keeps no entry at all at the benchmark's shortest length, when a length counts the
      sample's prompt and new tokens (RULER, NIAH): every sample would fail at its first compression
      (one too small for the protected windows shrinks them: `centroidkv.cache.budget.fit_protected`). In
      bytes the compressed heads' share is estimated (`centroidkv.head_policy.compressed_fraction`); the
      cache checks the exact one at run time."""
    from centroidkv import get_method
    from centroidkv.storage_precision import StoragePrecision
    from eval.window_budget import window_budget_error

    errors = []
    for spec in specs:
        method = get_method(spec.name, **spec.params)
        if not method.compresses:
            continue
        fraction, policy = spec.budget, HeadPolicy.of(method)
        if policy.heads == "budget" and policy.listed_fraction(model_name) >= 1:
            errors.append(f"budgets: {spec.label} on {model_name}: {EVERY_HEAD_FAVOURED}")
            continue
        if budget_unit == "bytes":
            try:
                fraction = compressed_fraction(
                    spec.budget, policy.listed_fraction(model_name), policy.listed_boost
                )
            except ValueError as error:
                errors.append(f"budgets: {spec.label} in bytes on {model_name}: {error}")
                continue
        if not benchmark.length_is_tokens:
            continue
        shortest = min(benchmark.lengths)
        window_error = window_budget_error(method, model_name, spec.budget, shortest)
        if budget_unit == "bytes" and window_error:
            errors.append(
                f"budgets: {spec.label} in bytes on a {shortest}-token {benchmark.name} sample: {window_error}"
            )
            continue
        kept = budget_entries(fraction, shortest, 0)  # a length counts the prompt and the new tokens
        if budget_unit == "bytes":  # fewer bits per entry buy more entries (centroidkv.cache.quantization)
            import torch

            kept = StoragePrecision.of(method).storage.entries_in(kept, getattr(torch, dtype).itemsize)
        what = f"{spec.label} on a {shortest}-token {benchmark.name} sample (budget_unit={budget_unit})"
        try:
            fit_protected(kept, method.n_sink, method.n_recent, what)  # shorter windows, or no entry at all
        except ValueError as error:
            errors.append(f"budgets: {error}")
    return errors
