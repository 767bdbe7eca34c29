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

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from centroidkv.budget import (
    DEFAULT_BUDGET_UNIT,
    budget_entries,
    check_budget,
    check_budget_unit,
    fit_protected,
)
from centroidkv.errors import first_line
from centroidkv.heads import compressed_fraction
from centroidkv.model_names import check_model_name, declared_positions
from centroidkv.params import did_you_mean
from centroidkv.parsing import split_top_level
from centroidkv.run_options import DEFAULT_DECODE_BATCH, check_decode_batch
from eval.benchmarks import Benchmark, benchmark_names, build_benchmark
from eval.records import NAME_MAX

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "offline", "online")
DTYPES = ("float32", "bfloat16", "float16")
BYTES_PER_RECORD = 4096  # generous: a record holds its prediction, references and ~25 numbers

# The keys a composed config may hold (Hydra's `+key=value` can add any other: those are errors).
ROOT_KEYS = ("model", "method", "methods", "budgets", "budget_unit", "benchmark", "logger", "experiment_name",
             "results_dir", "retry_failed", "warmup", "overwrite", "share_prefill", "decode_batch",
             "kv_precision")  # fmt: skip
MODEL_KEYS = ("name", "dtype", "device")
METHOD_KEYS = ("name", "budget", "params")
LOGGER_KEYS = ("name", "project", "mode")


class ConfigError(ValueError):
    """One or more bad configuration values; `lines` holds one message per value."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dtype: str | None = None  # None: `centroidkv.models.default_dtype` of the device
    device: str | None = None  # None: `centroidkv.models.default_device`

    def resolved(self) -> tuple[str, str]:
        """(device, dtype) the model will run with: the harness passes both to `load_model`, so a job's
        identity names them before the model loads (a CPU job resumed on a GPU would change dtype)."""
        from centroidkv.models import default_device, default_dtype

        device = self.device or default_device()
        dtype = self.dtype or str(default_dtype(device)).removeprefix("torch.")
        return device, dtype

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> tuple[ModelConfig, list[str]]:
        """The `model` node as a ModelConfig, and one line per bad value (torch is not imported: a CUDA
        device's availability is `device_errors`)."""
        errors = []
        name, dtype, device = raw.get("name"), raw.get("dtype"), raw.get("device")
        try:  # a known name, or a random-* model with a depth (random-llama3.1-8b:2)
            check_model_name(name)
        except ValueError as error:
            errors.append(f"model.name: {error}")
        if dtype is not None and dtype not in DTYPES:
            errors.append(
                f"model.dtype: must be one of {', '.join(DTYPES)} or null, got {dtype!r}"
                + did_you_mean(dtype, DTYPES)
            )
        if device is not None and (
            not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device)
        ):
            errors.append(f"model.device: must be cpu, cuda or cuda:N, got {device!r}")
        return cls(name=str(name), dtype=dtype, device=device), errors

    def device_errors(self) -> list[str]:
        """A line when the model asks for CUDA and no CUDA device is available (imports torch)."""
        if self.device is None or not self.device.startswith("cuda"):
            return []
        import torch

        if torch.cuda.is_available():
            return []
        return [f"model.device: {self.device} requested but no CUDA device is available"]


@dataclass(frozen=True, eq=True)
class MethodSpec:
    """One compression method with its parameters, evaluated at one budget.

    `variant` names this configuration of the method (by default the method's own name): a job may
    hold several variants of one method, e.g. `centroidkv` and `csm_pre_rope`, sharing each prefill.
    """

    name: str
    budget: float
    params: dict[str, Any] = field(default_factory=dict)
    variant: str = ""

    def __post_init__(self) -> None:
        if not self.variant:
            object.__setattr__(self, "variant", self.name)

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.budget:g}"

    def __hash__(self) -> int:
        return hash(
            (self.name, self.variant, self.budget, json.dumps(self.params, sort_keys=True, default=str))
        )


@dataclass(frozen=True)
class LoggerConfig:
    name: str
    project: str = "centroidkv"
    mode: str = "auto"  # auto: online when W&B is configured, offline otherwise

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> tuple[LoggerConfig, list[str]]:
        """The `logger` node as a LoggerConfig, and one line per bad value."""
        errors = []
        if raw.get("name") not in LOGGERS:
            errors.append(
                f"logger.name: must be one of {', '.join(LOGGERS)}, got {raw.get('name')!r}"
                + did_you_mean(raw.get("name"), LOGGERS)
            )
        mode = raw.get("mode", "auto")
        if mode not in LOGGER_MODES:
            errors.append(
                f"logger.mode: must be one of {', '.join(LOGGER_MODES)}, got {mode!r}"
                + did_you_mean(mode, LOGGER_MODES)
            )
        return cls(
            name=str(raw.get("name")), project=str(raw.get("project", "centroidkv")), mode=mode
        ), errors


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    job: str
    job_dir: Path
    model: ModelConfig
    methods: tuple[MethodSpec, ...]
    benchmark: Benchmark
    logger: LoggerConfig
    budget_unit: str = DEFAULT_BUDGET_UNIT  # what a budget R counts (centroidkv.budget)
    retry_failed: bool = False
    warmup: bool = True
    overwrite: bool = False  # a job folder holding another config's records: set them aside, start again
    share_prefill: bool = True  # kvpress presses compress forks of one shared prefill (eval.evaluate)
    decode_batch: int = DEFAULT_DECODE_BATCH  # forks decoded together at most; 1: each alone, with TPOT
    overrides: tuple[str, ...] = ()  # the command line's overrides that name the job (`named_job`)

    def identity(self) -> dict[str, Any]:
        """Everything that changes the job's numbers, as flat `key: value` pairs (saved in config.yaml;
        a resumed job must match it). Not in it: where results go, logging, retry_failed, overwrite."""
        device, dtype = self.model.resolved()
        identity: dict[str, Any] = {
            "model.name": self.model.name,
            "model.dtype": dtype,
            "model.device": device.split(":")[0],  # cuda:0 and cuda:1 run the same numbers
            "warmup": self.warmup,  # timings of the first samples
            "budget_unit": self.budget_unit,
            "share_prefill": self.share_prefill,  # a press's prefill_s / compress_s
            "decode_batch": self.decode_batch,  # TPOT is measured only for forks decoded alone
        }
        identity.update({f"benchmark.{k}": v for k, v in self.benchmark.params().items()})
        for spec in self.methods:
            prefix = f"methods.{spec.variant}"
            identity[f"{prefix}.method"] = spec.name
            identity.update({f"{prefix}.params.{k}": v for k, v in spec.params.items()})
            identity.setdefault(f"{prefix}.budgets", []).append(spec.budget)
        for variant, fields in self.method_fields().items():  # e.g. CentroidKV's head file and its hash
            identity.update({f"methods.{variant}.{k}": v for k, v in fields.items()})
        return json.loads(json.dumps(identity, default=str))  # plain values, as read back from YAML

    def method_fields(self) -> dict[str, dict[str, Any]]:
        """Per variant, what decides its numbers beyond its parameters (`Method.identity_fields`, e.g.
        the outlier-head file CentroidKV reads, with its content hash): in the identity and every record."""
        from centroidkv import get_method

        specs = {spec.variant: spec for spec in self.methods}
        return {
            variant: get_method(spec.name, **spec.params).identity_fields(self.model.name)
            for variant, spec in specs.items()
        }

    @property
    def needed_bytes(self) -> int:
        """A generous estimate of the records' size, for the free-space check."""
        return self.benchmark.n_expected_samples() * len(self.methods) * BYTES_PER_RECORD + 2**20


# Job folder names: <benchmark>-<method or N methods>-<budgets>-<hash of the override string>
# (`job_name`). Folders named the ways of versions before 2026-12 are not resumed (a new folder starts).
JOB_HASH_CHARS = 6
JOB_PART_CHARS = 40  # a variant's name or the budgets, cut past this (the hash tells them apart)


def split_overrides(override_dirname: str) -> list[str]:
    """Hydra's override_dirname (`a=1,b=[x,y]`) split at its top-level commas into overrides."""
    return split_top_level(override_dirname)


def _safe(text: str) -> str:
    """Filesystem-safe: list brackets and quotes dropped, commas inside a value as +, the rest _."""
    text = re.sub(r"[\[\]{}()'\"\s]", "", text).replace(",", "+")
    return re.sub(r"[^A-Za-z0-9._@+-]", "_", text)


def override_hash(override_dirname: str) -> str:
    """JOB_HASH_CHARS hex digits of the override string: the same overrides, the same hash."""
    return hashlib.sha1(override_dirname.strip().encode()).hexdigest()[:JOB_HASH_CHARS]


def job_name(benchmark: str, methods: tuple[MethodSpec, ...], override_dirname: str) -> str:
    """A job's folder name, short and stable: `<benchmark>-<methods>-<budgets>-<hash>`, e.g.
    `ruler-3methods-0.25+0.5-706c2b` or `toy-snapkv-0.5-1a2b3c`.

    <methods> is the variant's name when the job has one, else the number of variants; <budgets> the
    budgets of the methods that compress, joined by `+` (left out when only the full cache runs);
    <hash> is the hash of the whole override string (`override_hash`), so jobs of other overrides
    never share a name and the same overrides always give the same one. The overrides themselves are
    in the folder's config.yaml (`overrides`).
    """
    variants = list(dict.fromkeys(spec.variant for spec in methods))
    shown = _safe(variants[0])[:JOB_PART_CHARS] if len(variants) == 1 else f"{len(variants)}methods"
    references = _references(methods)
    budgets = sorted({spec.budget for spec in methods if spec.variant not in references})
    parts = [_safe(benchmark)[:JOB_PART_CHARS], shown]
    if budgets:
        parts.append("+".join(f"{budget:g}" for budget in budgets)[:JOB_PART_CHARS].rstrip("+"))
    return "-".join([*parts, override_hash(override_dirname)])


def _references(methods: tuple[MethodSpec, ...]) -> set[str]:
    """The variants that do not compress (the full cache: one reference run at 1.0, whatever the budgets)."""
    from centroidkv.methods import method_class

    return {spec.variant for spec in methods if not method_class(spec.name).compresses}


def named_job(cfg: RunConfig, override_dirname: str) -> RunConfig:
    """`cfg` named by its overrides (`job_name`), in its experiment's folder, with the overrides kept
    (`RunConfig.overrides`, saved in config.yaml)."""
    name = job_name(cfg.benchmark.name, cfg.methods, override_dirname)
    experiment_dir = cfg.job_dir.parent
    return replace(
        cfg,
        job=name,
        job_dir=experiment_dir / name,
        overrides=tuple(split_overrides(override_dirname.strip())),
    )


DEFAULT_BUDGET = (
    0.5  # `method.budget` of every method's config: R, the cache ratio of (prompt + max new tokens)
)


def store_configs() -> None:
    """Register Hydra's `model/<name>`, `method/<name>` and `benchmark/<name>` options, built from
    the registries.

    Each model of `centroidkv.models.MODEL_NAMES` becomes `model=<name>` (dtype and device null: the
    defaults of `centroidkv.models`); each registered method (the library's, one module in
    `baselines/`, or from an entry point) becomes `method=<name>` with `params` = its dataclass
    defaults, the only place defaults live, and `budget` = DEFAULT_BUDGET; each benchmark of
    `eval.benchmarks` becomes `benchmark=<name>` with its dataclass defaults. Call before Hydra
    composes (scripts/run.py does at startup). Names and defaults come through `eval.schema`, cached, so
    that a config error is one line without importing torch.
    """
    from hydra.core.config_store import ConfigStore

    from eval.schema import config_schema

    schema = config_schema()  # the registries' names and defaults, cached: torch is not imported
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


METHOD_ENTRY_KEYS = ("name", "variant", "params")


def _method_entry(
    entry: Any, method_raw: dict[str, Any], errors: list[str], names: list[str]
) -> tuple[str, str, dict[str, Any]] | None:
    """(method name, variant, parameters given) of one `methods` entry, or None after an error line.

    An entry is a registered name (of `names`: the schema's), or a mapping {name, variant, params}.
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
    return str(name), variant, params


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
    entries: list[tuple[str, str | None, dict[str, Any]]]  # (method, variant or None, parameters given)
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
    """The method entries (name, variant, params) and budgets of a run; what is wrong goes to `errors`."""
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
        name, variant, params = parsed
        if raw.get("kv_precision") is not None:  # the run's storage precision, unless the entry sets one
            params.setdefault("kv_precision", raw["kv_precision"])
        errors.extend(_method_line(variant, name, line) for line in method_errors(name, params, schema))
        entries.append((name, variant, params))
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
    """The run's switches are booleans; decode_batch and budget_unit pass their own checks."""
    errors = [
        f"{key}: must be true or false, got {raw.get(key)!r}"
        for key in ("retry_failed", "warmup", "overwrite", "share_prefill")
        if not isinstance(raw.get(key, False), bool)
    ]
    checks = (
        (check_decode_batch, raw.get("decode_batch", DEFAULT_DECODE_BATCH)),
        (check_budget_unit, raw.get("budget_unit", DEFAULT_BUDGET_UNIT)),
    )
    for check, value in checks:
        try:
            check(value)
        except ValueError as error:
            errors.append(str(error))
    return errors


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
    for name, variant, params in read.entries:
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
            specs.append(MethodSpec(name, 1.0, params, variant))
            continue
        specs.extend(MethodSpec(name, b, params, variant) for b in read.budgets)
    if not errors:
        errors.extend(_budget_errors(specs, benchmark, str(model_name), budget_unit, model.resolved()[1]))
    if errors:
        raise ConfigError(errors)
    experiment = read.experiment
    job_dir = Path(raw.get("results_dir") or "results").resolve() / experiment / job
    return RunConfig(
        experiment=experiment,
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
    )


def _positions_errors(model_name: str, benchmark: Benchmark) -> list[str]:
    """A line when a length (prompt and new tokens, RULER and NIAH) exceeds the model's positions,
    where they are known without torch (`centroidkv.model_names.declared_positions`)."""
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
      (one too small for the protected windows shrinks them: `centroidkv.budget.fit_protected`). In
      bytes the compressed heads' share is estimated (`centroidkv.heads.compressed_fraction`); the
      cache checks the exact one at run time."""
    from centroidkv import get_method
    from eval.window_budget import window_budget_error

    errors = []
    for spec in specs:
        method = get_method(spec.name, **spec.params)
        if not method.compresses:
            continue
        fraction = spec.budget
        if method.heads == "budget" and method.listed_fraction(model_name) >= 1:
            errors.append(f"budgets: {spec.label} on {model_name}: {EVERY_HEAD_FAVOURED}")
            continue
        if budget_unit == "bytes":
            try:
                fraction = compressed_fraction(
                    spec.budget, method.listed_fraction(model_name), method.listed_boost
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
        if budget_unit == "bytes":  # fewer bits per entry buy more entries (centroidkv.quantization)
            import torch

            kept = method.storage.entries_in(kept, getattr(torch, dtype).itemsize)
        what = f"{spec.label} on a {shortest}-token {benchmark.name} sample (budget_unit={budget_unit})"
        try:
            fit_protected(kept, method.n_sink, method.n_recent, what)  # shorter windows, or no entry at all
        except ValueError as error:
            errors.append(f"budgets: {error}")
    return errors
