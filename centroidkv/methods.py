"""The one interface every compression method implements, and the registry of methods by name.

A method sees one layer's *mergeable segment* (the cache without its protected sinks and recent
window) and shrinks it to `target_len` tokens. The cache decides when to call it and what the budget
is; methods only decide which tokens survive (eviction) or how they combine (merging).

Methods are found, not listed: the library's own method (`centroidkv.centroidkv`) is imported on the
first look-up, and so is every object that an installed distribution declares under the entry-point
group `centroidkv.methods` (a module, a package whose modules are all imported, or a `Method` class).
A module registers its methods with `@register`. The harness's baselines come the same way: this
repository's pyproject.toml declares its `baselines` package under the group, and a declared package
is scanned again at every look-up, so adding a method is one file dropped into `baselines/`. Or ship
it in your own package with, in its pyproject.toml,

    [project.entry-points."centroidkv.methods"]
    my_method = "my_package.my_method"
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import pkgutil
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from centroidkv.calibrate import HEAD_SCORES
from centroidkv.files import is_file
from centroidkv.heads import HEAD_POLICIES, check_head_source
from centroidkv.kv import LayerKV, LayerStats
from centroidkv.needs import Need
from centroidkv.params import check_param, field_rules, param, param_errors, unknown_params_error
from centroidkv.parsing import parse_method_spec, shorthand_error
from centroidkv.quantization import (
    DEFAULT_GROUP,
    DEFAULT_RESIDUAL,
    GROUP_RULE,
    PRECISIONS,
    RESIDUAL_RULE,
    STORAGE_PARAMS,
    StorageFormat,
    check_precision,
)
from centroidkv.registry import METHOD_ENTRY_POINTS, Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "LayerKV",
    "LayerStats",
    "Method",
    "Need",
    "check_float",
    "check_int",
    "get_method",
    "method_class",
    "method_label",
    "method_names",
    "method_variant",
    "param",
    "parse_method",
    "precision_suffix",
    "register",
]

ENTRY_POINT_GROUP = METHOD_ENTRY_POINTS
# The library's own method; every other one (the harness's baselines too) comes through the group.
BUILTIN_METHOD_MODULE = "centroidkv.centroidkv"


@dataclass
class Method:
    """Base class: shared parameters and their validation.

    Parameters common to every method:
      n_sink: first tokens never compressed (attention sinks).
      n_recent: last tokens never compressed (recent window).
      compress_interval: g, decoding re-compresses when the cache reaches budget + g.
      heads: the head policy (`centroidkv.heads`): "none", "whole" (the listed KV heads keep every
        entry) or "budget" (the listed heads keep `heads_boost` times the entries of the others).
      heads_file: which heads are listed: the model's calibration by a score, "clustering" (the
        output error under CentroidKV's clustering: the paper's outlier heads), "needle" (attention
        on the answer's tokens: retrieval heads), "streaming" (the output error of a streaming
        window: DuoAttention's criterion), or a file's path.
      heads_fraction: the worst fraction of all (layer, KV head) pairs that is listed.
      heads_boost: under heads=budget, the listed heads' entries over the others' (> 1).
      kv_precision, kv_group, kv_residual: how the cache stores keys and values
        (`centroidkv.quantization`): "model" (the model's dtype, the default), "bf16", "fp16", or
        KIVI's integer codes "int8" / "int4" / "int2" in groups of kv_group with the newest
        kv_residual tokens in full precision. At "model" they are left out of `params()`, so runs
        without a precision keep their identity.
    Subclasses declare their own parameters as dataclass fields with their paper's defaults, each
    field's simple rule with `param` (`centroidkv.params`: checked by `validate` for every field, and
    without torch by `centroidkv.schema`; `at_most=` bounds it by another field), and extend
    `validate` only with checks that read a file or build an object.
    A field redefined with a plain default keeps its base class's rule.
    """

    name: ClassVar[str] = "base"
    label: ClassVar[str] = ""  # display name in tables and figures; defaults to `name`
    compresses: ClassVar[bool] = True  # False for the full cache
    merges: ClassVar[bool] = False  # True when log_degree changes (CentroidKV, K-Means, CaM)
    # The parameter that a command line's `name:value` sets (`parse_method`), e.g. a wrapper's target.
    shorthand: ClassVar[str | None] = None

    n_sink: int = param(16, minimum=0)
    n_recent: int = param(64, minimum=0)
    compress_interval: int = param(64, minimum=1)
    heads: str = param("none", choices=HEAD_POLICIES)
    heads_file: str = param("clustering", reason=f"{' or '.join(HEAD_SCORES)} or a path")
    heads_fraction: float = param(0.04, minimum=0.0, maximum=1.0)
    heads_boost: float = param(4.0, minimum=1, low_open=True)
    kv_precision: str = param("model", choices=PRECISIONS)
    kv_group: int = param(DEFAULT_GROUP, **GROUP_RULE)
    kv_residual: int = param(DEFAULT_RESIDUAL, **RESIDUAL_RULE)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "label" not in cls.__dict__:  # a subclass without its own label shows its own name
            cls.label = cls.name

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def label_for(cls, params: dict[str, Any]) -> str:
        """The display label of a run with these parameters (a wrapper method may name what it wraps)."""
        return cls.label or cls.name

    @classmethod
    def variant_for(cls, params: dict[str, Any]) -> str:
        """The variant name of a run that names none (a wrapper method names what it wraps, so that a
        job can hold several of it); a run under this name is shown by `label_for`."""
        return cls.name

    def needs(self) -> tuple[Need, ...]:
        """What the cache must record for this method (`centroidkv.needs`): none by default."""
        return ()

    @property
    def rows_independent(self) -> bool:
        """Whether each batch row is compressed as if alone (False when a data-driven count is shared
        by the rows of a batch, e.g. CentroidKV's adaptive schedule: tensors stay rectangular)."""
        return True

    # --- the head policy (centroidkv.heads) ---------------------------------------------------------
    @property
    def lists_heads(self) -> bool:
        """Whether the head policy lists any head (a policy, a fraction above 0, a method that compresses)."""
        return self.heads != "none" and self.heads_fraction > 0 and self.compresses

    def head_file(self, model_name: str) -> Path | None:
        """The head file this policy reads on `model_name`: its path, or for a score the user's
        calibration, else the package's, else the user's file that calibration would write; None when
        no head is listed (heads=none, a fraction of 0, or one that rounds to no head of the model)."""
        if not self.lists_heads:
            return None
        shape = _model_shape(model_name)
        if shape is not None and round(self.heads_fraction * shape[0] * shape[1]) == 0:
            return None
        from centroidkv.calibrate import HEAD_SCORES, head_file_for, user_head_file

        if str(self.heads_file) not in HEAD_SCORES:
            return Path(self.heads_file)
        return head_file_for(model_name, self.heads_file) or user_head_file(model_name, self.heads_file)

    def check_model(self, model_name: str) -> None:
        """Raise ValueError when this method's parameters cannot run on `model_name` (checked by the
        runner's config validation, before any model loads): a head file calibrated on another model,
        or for another shape (layers x KV heads, when known without loading the model)."""
        from centroidkv.calibrate import HEAD_SCORES, check_head_file, read_head_file

        explicit = self.heads != "none" and str(self.heads_file) not in HEAD_SCORES
        path = self.head_file(model_name)
        if path is not None and (explicit or is_file(path)):  # a score without a file: calibrated on load
            check_head_file(path, read_head_file(path), model_name, _model_shape(model_name))

    def identity_fields(self, model_name: str) -> dict[str, Any]:
        """What, beyond its parameters, decides this method's numbers on `model_name`, known before the
        model loads; the runner adds each field to the job's identity (`methods.<variant>.<key>`) and to
        every record. Here: the head file a policy reads, with its content hash (`heads_file_read`):
        a user calibration written later changes what a score reads, so it changes the identity."""
        path = self.head_file(model_name)
        if path is None:
            return {}
        from centroidkv.calibrate import head_file_identity

        return {"heads_file_read": head_file_identity(path)}

    def listed_fraction(self, model_name: str) -> float:
        """The fraction of `model_name`'s KV heads the policy lists, known before the model loads (the
        runner refuses a byte budget these heads alone would exceed). 0 when none is listed, or when
        a score has no file yet: the runner calibrates it when the model loads."""
        path = self.head_file(model_name)
        if path is None or not is_file(path):
            return 0.0
        from centroidkv.calibrate import read_head_file, worst_heads

        data = read_head_file(path)
        listed = sum(len(heads) for heads in worst_heads(data["errors"], self.heads_fraction).values())
        return listed / (data["n_layers"] * data["n_kv_heads"])

    @property
    def listed_boost(self) -> float:
        """How many times the entries of the other heads a listed head keeps (inf: every entry)."""
        return math.inf if self.heads == "whole" else self.heads_boost

    def calibration_settings(self) -> dict[str, Any] | None:
        """The parameters compared with those a head file was calibrated with (None: not compared)."""
        return None

    def listed_heads(self, model) -> dict[int, list[int]]:
        """KV heads, per layer index, that the head policy lists (kept whole under heads=whole, given
        more entries under heads=budget); called once when a cache first compresses on `model`, so it
        only reads a file, never runs the model (`centroidkv.calibrate.CalibrationMissing`)."""
        if not self.lists_heads:
            return {}
        from centroidkv.calibrate import listed_heads_for

        return listed_heads_for(model, self.heads_file, self.heads_fraction, self.calibration_settings())

    @classmethod
    def rules(cls) -> dict[str, dict[str, Any]]:
        """Every parameter's rule (`centroidkv.params.field_rules`), as `validate` and the torch-free
        schema (`centroidkv.schema`) check it; a method whose allowed values are known only at run time
        (kvpress's press names) adds them here."""
        return field_rules(cls)

    def validate(self) -> None:
        """Every field by its rule (`rules`: bounds by other fields included), then what reads a file
        or builds an object; a subclass extends this with checks of its own of that kind."""
        rules = type(self).rules()
        # the same lines as the torch-free schema's check (`centroidkv.schema.method_errors`)
        problems = param_errors(self.name, {name: getattr(self, name) for name in rules}, rules)
        if problems:
            raise ValueError(problems[0])
        check_head_source(self.heads, self.heads_file)
        check_precision(self.kv_precision, self.kv_group, self.kv_residual, self.name)
        if self.heads != "none" and not self.compresses:
            raise ValueError(f"{self.name}: a head policy needs a method that compresses (heads=none)")

    def layer_budget(self, budget_len: int, layer_idx: int, n_layers: int) -> int:
        """Tokens this layer may keep; methods with per-layer budgets (PyramidKV) override it."""
        return budget_len

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        """Shrink the mergeable segment `kv` to exactly `target_len` tokens."""
        raise NotImplementedError

    @property
    def storage(self) -> StorageFormat:
        """How the cache stores this method's keys and values (`centroidkv.quantization`)."""
        return StorageFormat(self.kv_precision, self.kv_group, self.kv_residual)

    def params(self) -> dict:
        """The parameters; the storage ones only when a precision is set (records and job identities
        of runs in the model's dtype stay as they were)."""
        return _recorded(dataclasses.asdict(self))

    @classmethod
    def default_params(cls) -> dict:
        """`params()` of the method built with its defaults, without building it (so without what its
        `validate` may import: the configuration's schema, `centroidkv.schema`)."""
        return _recorded({name: copy.deepcopy(rule["default"]) for name, rule in field_rules(cls).items()})


def _recorded(params: dict[str, Any]) -> dict[str, Any]:
    """A method's parameters as runs record them: without the storage ones in the model's dtype."""
    if params.get("kv_precision") == "model":
        for name in STORAGE_PARAMS:
            params.pop(name)
    return params


def check_int(method: Method, field: str, minimum: int) -> None:
    """Raise one clear ValueError unless the field is an integer (not a bool) >= `minimum`. For
    plug-ins' own checks; a field's simple rule is better declared with `param` (checked without torch)."""
    check_param(method.name, field, getattr(method, field), {"type": "int", "minimum": minimum})


def check_float(method: Method, field: str, low: float, high: float, low_open: bool = False) -> None:
    """Raise one clear ValueError unless `low <= value <= high` (or `low < value` when low_open); see
    `check_int`."""
    rule = {"type": "float", "minimum": low, "maximum": high, "low_open": low_open}
    check_param(method.name, field, getattr(method, field), rule)


def _model_shape(model_name: str) -> tuple[int, int] | None:
    """(layers, KV heads) of a named model without loading it; None when unknown (a hub model not in
    the local cache, or a name the config validation reports on its own)."""
    from centroidkv.model_specs import model_shape

    try:
        return model_shape(model_name)
    except ValueError:
        return None


REGISTRY: Registry[type[Method]] = Registry("method")


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available to `get_method(cls.name)`; a name taken by another
    class is refused (`centroidkv.registry.Registry`)."""
    return REGISTRY.register(cls)


def _import_all(target: ModuleType | str) -> None:
    """Import a module, or every module of a package (skipping private `_name` modules)."""
    module = importlib.import_module(target) if isinstance(target, str) else target
    if not hasattr(module, "__path__"):
        return
    for info in pkgutil.iter_modules(module.__path__, prefix=f"{module.__name__}."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        if info.name not in sys.modules:
            importlib.invalidate_caches()  # the file may have been created after the first look-up
        importlib.import_module(info.name)


_plugins_loaded = False
_plugin_packages: list[ModuleType] = []  # declared packages, scanned again at every look-up


def _load_plugins() -> None:
    """Import what installed distributions declare under the entry-point group (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry_point.load()
        except Exception as error:  # a broken plug-in must not take the harness's own methods down
            warnings.warn(
                f"method plug-in {entry_point.name!r} ({entry_point.value}) failed to load: "
                f"{type(error).__name__}: {error}",
                stacklevel=2,
            )
            continue
        if isinstance(loaded, ModuleType):
            _import_all(loaded)
            if hasattr(loaded, "__path__"):
                _plugin_packages.append(loaded)
        elif isinstance(loaded, type) and issubclass(loaded, Method):
            register(loaded)


def _load_all() -> None:
    # Declared packages are scanned again on every look-up (cheap), so a file dropped into baselines/
    # is found without restarting; entry points themselves are read once.
    importlib.import_module(BUILTIN_METHOD_MODULE)
    _load_plugins()
    for package in _plugin_packages:
        _import_all(package)


def method_names() -> list[str]:
    """Every registered method's name: the library's own first, then the declared ones (the harness's
    baselines included), in discovery order."""
    _load_all()
    return list(REGISTRY)


def method_class(name: str) -> type[Method]:
    """The registered class of `name`; ValueError (one line) for an unknown name."""
    _load_all()
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def method_label(name: str, params: dict[str, Any] | None = None) -> str:
    """The display label of a method run (its class's `label_for`); the bare name when unregistered."""
    try:
        cls = method_class(name)
    except ValueError:  # records of a method that is no longer installed keep their name
        return name
    params = dict(params or {})
    return cls.label_for(params) + precision_suffix(params)


def precision_suffix(params: dict[str, Any]) -> str:
    """What a run's label adds for its storage precision (" @int8"); nothing in the model's dtype."""
    precision = params.get("kv_precision", "model")
    return "" if precision in ("model", None) else f" @{precision}"


def method_variant(name: str, params: dict[str, Any] | None = None) -> str:
    """The default variant name of a method run (its class's `variant_for`); the name when unregistered."""
    try:
        cls = method_class(name)
    except ValueError:
        return name
    params = dict(params or {})
    precision = params.get("kv_precision", "model")
    suffix = "" if precision in ("model", None) else f"-{precision}"
    return cls.variant_for(params) + suffix


def get_method(name: str, **params) -> Method:
    """Build a registered method with keyword parameters; unknown names and parameters raise ValueError."""
    cls = method_class(name)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(params) - known
    if unknown:
        raise ValueError(unknown_params_error(name, unknown, known))
    return cls(**params)


def parse_method(spec: str) -> Method:
    """A method from its command-line form: `name`, `name:value` (the class's `shorthand` parameter,
    e.g. a wrapper's target) or `name(key=value, ...)` with Python literals or bare words as values,
    e.g. `centroidkv(n_recent=32, heads=none)`. ValueError (one line) for anything else."""
    name, short, params = parse_method_spec(spec)  # the one parser (centroidkv.parsing)
    if short is not None:
        field_name = method_class(name).shorthand
        if field_name is None:
            raise ValueError(shorthand_error(spec, name))
        params = {field_name: short, **params}
    return get_method(name, **params)
