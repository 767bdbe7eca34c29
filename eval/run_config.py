"""The typed run configuration a composed Hydra config is validated into (`eval.config`): the model,
the methods, the logger and the run, each a frozen dataclass; `ConfigError` holds one line per bad value."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from centroidkv.cache.budget import DEFAULT_BUDGET_UNIT
from centroidkv.models.model_names import check_model_name
from centroidkv.params import did_you_mean
from centroidkv.plan.run_options import DEFAULT_DECODE_BATCH
from eval.benchmarks import Benchmark

LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "offline", "online")
DTYPES = ("float32", "bfloat16", "float16")
BYTES_PER_RECORD = 4096  # generous: a record holds its prediction, references and ~25 numbers


class ConfigError(ValueError):
    """One or more bad configuration values; `lines` holds one message per value."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dtype: str | None = None  # None: `centroidkv.models.loading.default_dtype` of the device
    device: str | None = None  # None: `centroidkv.models.loading.default_device`

    def resolved(self) -> tuple[str, str]:
        """(device, dtype) the model will run with: the harness passes both to `load_model`, so a job's
        identity names them before the model loads (a CPU job resumed on a GPU would change dtype)."""
        from centroidkv.models.loading import default_device, default_dtype

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
    `samples` caps the samples it runs on per task and length (the first ones, so that they share
    their prefill with the other methods): a count, or {length: count} (lengths not named: no cap).
    """

    name: str
    budget: float
    params: dict[str, Any] = field(default_factory=dict)
    variant: str = ""
    samples: int | dict[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.variant:
            object.__setattr__(self, "variant", self.name)

    def runs_on(self, length: int | None, position: int) -> bool:
        """Whether the sample at `position` (0, 1, ...) among its task's samples of `length` is run."""
        cap = self.samples.get(length) if isinstance(self.samples, dict) else self.samples
        return cap is None or position < cap

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
class PrefillStoreConfig:
    """Where the native prefills are kept for later jobs on the same model and prompts
    (`centroidkv.plan.prefill_store`): at most `max_gb` gigabytes (0: no store, the default) in `dir`
    (None: `<cache dir>/prefills`). Not in the job's identity: it changes no record but
    `prefill_stored`."""

    max_gb: float = 0.0
    dir: str | None = None

    @classmethod
    def parse(cls, raw: Any) -> tuple[PrefillStoreConfig, list[str]]:
        """The `prefill_store` node (null: no store), and one line per bad value."""
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            return cls(), [f"prefill_store: must be a mapping {{max_gb, dir}} or null, got {raw!r}"]
        errors = [
            f"prefill_store.{key}: unknown key; prefill_store holds max_gb, dir"
            for key in raw
            if key not in PREFILL_STORE_KEYS
        ]
        max_gb, folder = raw.get("max_gb", 0.0), raw.get("dir")
        if isinstance(max_gb, bool) or not isinstance(max_gb, (int, float)) or not 0 <= max_gb < float("inf"):
            errors.append(
                f"prefill_store.max_gb: must be a number of gigabytes >= 0 (0: off), got {max_gb!r}"
            )
            max_gb = 0.0
        if folder is not None and (not isinstance(folder, str) or not folder):
            errors.append(
                f"prefill_store.dir: must be a folder or null (the cache dir's prefills), got {folder!r}"
            )
            folder = None
        return cls(float(max_gb), folder), errors


PREFILL_STORE_KEYS = ("max_gb", "dir")


@dataclass(frozen=True)
class RunConfig:
    experiment: str
    job: str
    job_dir: Path
    model: ModelConfig
    methods: tuple[MethodSpec, ...]
    benchmark: Benchmark
    logger: LoggerConfig
    budget_unit: str = DEFAULT_BUDGET_UNIT  # what a budget R counts (centroidkv.cache.budget)
    retry_failed: bool = False
    warmup: bool = True
    overwrite: bool = False  # a job folder holding another config's records: set them aside, start again
    share_prefill: bool = True  # kvpress presses compress forks of one shared prefill (eval.evaluate)
    decode_batch: int = DEFAULT_DECODE_BATCH  # forks decoded together at most; 1: each alone, with TPOT
    workers: int = 1  # processes the samples are spread over (eval.workers); not in the identity
    prefill_store: PrefillStoreConfig = PrefillStoreConfig()  # not in the identity
    overrides: tuple[str, ...] = ()  # the command line's overrides that name the job (`named_job`)

    def identity(self) -> dict[str, Any]:
        """Everything that changes the job's numbers, as flat `key: value` pairs (saved in config.yaml;
        a resumed job must match it). Not in it: where results go, logging, retry_failed, overwrite,
        workers (the records are the same over any number)."""
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
            if spec.samples is not None:  # absent when uncapped: older jobs keep their identity
                identity[f"{prefix}.samples"] = spec.samples
        for variant, fields in self.method_fields().items():  # e.g. CentroidKV's head file and its hash
            identity.update({f"methods.{variant}.{k}": v for k, v in fields.items()})
        return json.loads(json.dumps(identity, default=str))  # plain values, as read back from YAML

    def method_fields(self) -> dict[str, dict[str, Any]]:
        """Per variant, what decides its numbers beyond its parameters (`identity_fields` of the method
        and its wrappers, e.g. the outlier-head file CentroidKV's head policy reads, with its content
        hash): in the identity and every record."""
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
