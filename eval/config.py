"""Typed run configuration: the composed Hydra config validated into dataclasses before anything loads.

`build_run_config(cfg, job)` checks every value and raises `ConfigError` with one line per bad value,
so `scripts/run.py` can print them and exit without loading a model or writing a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eval.longbench.constants import EN_DATASETS

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# RULER's 13 tasks (BENCHMARKS.md); the generator in eval.ruler is the authority when it is importable.
RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
LONGBENCH_DATASETS = EN_DATASETS
BENCHMARKS = ("ruler", "longbench", "niah", "toy")
LOGGERS = ("wandb", "none")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """One or more bad configuration values; `lines` holds one message per value."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    device: str | None = None  # None: cuda when available


@dataclass(frozen=True, eq=True)
class MethodSpec:
    """One compression method with its parameters, evaluated at one budget."""

    name: str
    budget: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.budget:g}"

    def __hash__(self) -> int:
        return hash((self.name, self.budget, json.dumps(self.params, sort_keys=True, default=str)))


@dataclass(frozen=True)
class BenchmarkConfig:
    name: str
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    n_samples: int
    seed: int = 0
    max_new_tokens: int | None = None  # cap on the per-task generation length
    context_only: bool = False  # compress the context only, feed the question uncompressed
    data_dir: str | None = None
    depths: tuple[float, ...] = ()  # NIAH needle depths in percent
    ignore_eos: bool = False  # decode exactly max_new_tokens (speed runs)


@dataclass(frozen=True)
class LoggerConfig:
    name: str
    project: str = "centroidkv"
    mode: str = "auto"  # auto: online when W&B is configured, offline otherwise


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    job: str
    job_dir: Path
    model: ModelConfig
    methods: tuple[MethodSpec, ...]
    benchmark: BenchmarkConfig
    logger: LoggerConfig
    retry_failed: bool = False
    warmup: bool = True

    @property
    def max_query_window(self) -> int:
        from centroidkv import get_method

        return max((get_method(m.name, **m.params).query_window for m in self.methods), default=0)


def job_name_from_overrides(override_dirname: str) -> str:
    """A directory name for a job: its Hydra overrides (`a=1,b=x`), or `default` when there are none."""
    name = re.sub(r"[^A-Za-z0-9=,._@+-]", "_", override_dirname.strip())
    if len(name) > 150:  # keep folder names short and still unique: a prefix plus a hash of the whole
        name = f"{name[:130]}-{hashlib.sha1(name.encode()).hexdigest()[:12]}"
    return name or "default"


def _method_file_params(name: str) -> dict[str, Any]:
    path = CONFIG_DIR / "method" / f"{name}.yaml"
    if not path.exists():
        return {}
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    return dict(data.get("params") or {})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_budget(value: Any, where: str, errors: list[str]) -> float | None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= 1
        or math.isnan(value)
    ):
        errors.append(f"{where}: budget must be a fraction in (0, 1], got {value!r}")
        return None
    return float(value)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def build_run_config(cfg: DictConfig | dict, job: str = "default") -> RunConfig:
    """Validate a composed config; raise ConfigError (one line per bad value) or return a RunConfig."""
    from centroidkv import get_method, method_names
    from centroidkv.models import check_model_name

    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    errors: list[str] = []

    # --- model ---
    model_raw = raw.get("model") or {}
    model_name = model_raw.get("name")
    try:  # a known name, or a random-* model with a depth (random-llama3.1-8b:2)
        check_model_name(model_name)
    except ValueError as error:
        errors.append(f"model.name: {error}")
    dtype = model_raw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        errors.append(f"model.dtype: must be one of {', '.join(DTYPES)} or null, got {dtype!r}")
    device = model_raw.get("device")
    if device is not None:
        if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            errors.append(f"model.device: must be cpu, cuda or cuda:N, got {device!r}")
        elif device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                errors.append(f"model.device: {device} requested but no CUDA device is available")
    model = ModelConfig(name=str(model_name), dtype=dtype, device=device)

    # --- methods x budgets ---
    method_raw = raw.get("method") or {}
    known = method_names()
    names = _as_list(raw.get("methods")) or [method_raw.get("name")]
    budgets_raw = _as_list(raw.get("budgets")) or _as_list(method_raw.get("budget"))
    if not budgets_raw:
        errors.append("budgets: at least one budget is needed (method.budget or budgets)")
    budgets = [b for b in (_check_budget(v, "budgets", errors) for v in budgets_raw) if b is not None]
    if len(set(budgets)) != len(budgets):
        errors.append(f"budgets: duplicates in {budgets_raw}")
    specs: list[MethodSpec] = []
    if len(set(map(str, names))) != len(names):
        errors.append(f"methods: duplicates in {names}")
    for name in names:
        if name not in known:
            errors.append(f"methods: unknown method {name!r}; registered: {', '.join(known)}")
            continue
        params = _method_file_params(name)
        if method_raw.get("name") == name:
            params.update(method_raw.get("params") or {})
        try:
            method = get_method(name, **params)
        except (ValueError, TypeError) as error:
            errors.append(f"method {name}: {str(error).splitlines()[0]}")
            continue
        if not method.compresses:  # the full cache is one reference run, whatever the budgets
            specs.append(MethodSpec(name, 1.0, params))
            continue
        specs.extend(MethodSpec(name, b, params) for b in budgets)

    # --- benchmark ---
    bench_raw = raw.get("benchmark") or {}
    bench_name = bench_raw.get("name")
    if bench_name not in BENCHMARKS:
        errors.append(
            f"benchmark.name: unknown benchmark {bench_name!r}; choose one of {', '.join(BENCHMARKS)}"
        )
    tasks = _as_list(bench_raw.get("tasks"))
    if bench_name == "ruler":
        valid_tasks = _ruler_tasks()
        for task in tasks:
            if task not in valid_tasks:
                errors.append(
                    f"benchmark.tasks: unknown RULER task {task!r}; choose from {', '.join(valid_tasks)}"
                )
    elif bench_name == "longbench":
        for task in tasks:
            if task.removesuffix("_e") not in LONGBENCH_DATASETS:
                errors.append(
                    f"benchmark.tasks: unknown LongBench dataset {task!r}; choose from {', '.join(LONGBENCH_DATASETS)}"
                )
    if not tasks and bench_name in ("ruler", "longbench", "toy"):
        errors.append("benchmark.tasks: at least one task is needed")
    lengths = _as_list(bench_raw.get("lengths"))
    for length in lengths:
        if not _is_int(length) or length < 16:
            errors.append(f"benchmark.lengths: each length must be an integer >= 16 tokens, got {length!r}")
    if not lengths and bench_name != "longbench":
        errors.append("benchmark.lengths: at least one context length is needed")
    n_samples = bench_raw.get("n_samples")
    if not _is_int(n_samples) or n_samples < 1:
        errors.append(f"benchmark.n_samples: must be an integer >= 1, got {n_samples!r}")
    seed = bench_raw.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        errors.append(f"benchmark.seed: must be an integer >= 0, got {seed!r}")
    cap = bench_raw.get("max_new_tokens")
    if cap is not None and (not _is_int(cap) or cap < 1):
        errors.append(f"benchmark.max_new_tokens: must be an integer >= 1 or null, got {cap!r}")
    depths = _as_list(bench_raw.get("depths"))
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 100:
            errors.append(f"benchmark.depths: each depth must be a percentage in [0, 100], got {depth!r}")
    if bench_name == "niah" and not depths:
        errors.append("benchmark.depths: NIAH needs at least one needle depth")
    for key in ("context_only", "ignore_eos"):
        if not isinstance(bench_raw.get(key, False), bool):
            errors.append(f"benchmark.{key}: must be true or false, got {bench_raw.get(key)!r}")
    benchmark = BenchmarkConfig(
        name=str(bench_name),
        tasks=tuple(map(str, tasks)),
        lengths=tuple(lengths),
        n_samples=n_samples if _is_int(n_samples) else 0,
        seed=seed if _is_int(seed) else 0,
        max_new_tokens=cap,
        context_only=bool(bench_raw.get("context_only", False)),
        ignore_eos=bool(bench_raw.get("ignore_eos", False)),
        data_dir=bench_raw.get("data_dir"),
        depths=tuple(float(d) for d in depths if isinstance(d, (int, float))),
    )

    # --- logger, run ---
    logger_raw = raw.get("logger") or {"name": "none"}
    if logger_raw.get("name") not in LOGGERS:
        errors.append(f"logger.name: must be one of {', '.join(LOGGERS)}, got {logger_raw.get('name')!r}")
    mode = logger_raw.get("mode", "auto")
    if mode not in ("auto", "offline", "online"):
        errors.append(f"logger.mode: must be auto, offline or online, got {mode!r}")
    logger = LoggerConfig(
        name=str(logger_raw.get("name")), project=str(logger_raw.get("project", "centroidkv")), mode=mode
    )
    experiment = raw.get("experiment_name")
    if not isinstance(experiment, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", experiment or ""):
        errors.append(f"experiment_name: must be a plain directory name, got {experiment!r}")
    for key in ("retry_failed", "warmup"):
        if not isinstance(raw.get(key, False), bool):
            errors.append(f"{key}: must be true or false, got {raw.get(key)!r}")
    if errors:
        raise ConfigError(errors)
    job_dir = Path(raw.get("results_dir") or "results").resolve() / experiment / job
    return RunConfig(
        experiment=experiment,
        job=job,
        job_dir=job_dir,
        model=model,
        methods=tuple(specs),
        benchmark=benchmark,
        logger=logger,
        retry_failed=bool(raw.get("retry_failed", False)),
        warmup=bool(raw.get("warmup", True)),
    )


def _ruler_tasks() -> tuple[str, ...]:
    try:
        from eval import ruler

        tasks = getattr(ruler, "TASKS", None)
        return tuple(tasks) if tasks else RULER_TASKS
    except ImportError:
        return RULER_TASKS
