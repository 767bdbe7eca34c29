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
import pkgutil
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, ClassVar

from centroidkv.head_policy import HeadPolicy
from centroidkv.kv import LayerKV, LayerStats
from centroidkv.needs import Need
from centroidkv.params import check_param, field_rules, param, param_errors
from centroidkv.parsing import parse_method_spec, shorthand_error
from centroidkv.registry import METHOD_ENTRY_POINTS, Registry
from centroidkv.storage_precision import StoragePrecision, precision_suffix
from centroidkv.wrapper import (
    MethodWrapper,
    label_suffix,
    variant_suffix,
    wrap,
    wrapped_defaults,
    wrapped_rules,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "LayerKV",
    "LayerStats",
    "HeadPolicy",
    "Method",
    "Need",
    "StoragePrecision",
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
    Every method also takes the parameters of its wrappers (`centroidkv.wrapper`), which `get_method`
    puts around it: the head policy (`heads`, `heads_file`, `heads_fraction`, `heads_boost`:
    `centroidkv.head_policy`) and the storage precision (`kv_precision`, `kv_group`, `kv_residual`:
    `centroidkv.storage_precision`). They are no fields of a method; a method that takes them
    otherwise than the wrappers' defaults says so in `wrapper_params`.
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
    # The parameter that a command line's `name:value` sets (`parse_method`), e.g. kvpress's press.
    shorthand: ClassVar[str | None] = None
    # The wrappers' parameters as this method takes them (`centroidkv.wrapper`), as a subclass would
    # redefine a field: a plain value is another default, a `param(...)` another rule with its reason.
    wrapper_params: ClassVar[dict[str, Any]] = {}
    # Whether a head file's recorded settings are compared with this method's (one warning line when
    # they differ: `centroidkv.head_policy.HeadPolicy.listed_heads`).
    compares_calibration: ClassVar[bool] = False

    n_sink: int = param(16, minimum=0)
    n_recent: int = param(64, minimum=0)
    compress_interval: int = param(64, minimum=1)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "label" not in cls.__dict__:  # a subclass without its own label shows its own name
            cls.label = cls.name

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def label_for(cls, params: dict[str, Any]) -> str:
        """The display label of a run with these parameters (kvpress's names the press it runs)."""
        return cls.label or cls.name

    @classmethod
    def variant_for(cls, params: dict[str, Any]) -> str:
        """The variant name of a run that names none (kvpress's names the press it runs, so that a job
        can hold several of it); a run under this name is shown by `label_for`."""
        return cls.name

    def needs(self) -> tuple[Need, ...]:
        """What the cache must record for this method (`centroidkv.needs`): none by default."""
        return ()

    @property
    def rows_independent(self) -> bool:
        """Whether each batch row is compressed as if alone (False when a data-driven count is shared
        by the rows of a batch, e.g. CentroidKV's adaptive schedule: tensors stay rectangular)."""
        return True

    def check_model(self, model_name: str) -> None:
        """Raise ValueError when this method cannot run on `model_name` (the runner's config validation,
        before any model loads); nothing here, a wrapper adds its own (the head policy's head file)."""

    def identity_fields(self, model_name: str) -> dict[str, Any]:
        """What, beyond its parameters, decides this method's numbers on `model_name`, known before the
        model loads; the runner adds each field to the job's identity (`methods.<variant>.<key>`) and to
        every record. Nothing here; a wrapper adds its own (the head file a head policy reads)."""
        return {}

    @classmethod
    def rules(cls) -> dict[str, dict[str, Any]]:
        """Every parameter's rule, its wrappers' included (`centroidkv.params.field_rules`,
        `centroidkv.wrapper.wrapped_rules`), as `get_method`, `validate` and the torch-free schema
        (`centroidkv.schema`) check it; a method whose allowed values are known only at run time
        (kvpress's press names) adds them here."""
        return wrapped_rules(cls, field_rules(cls))

    def validate(self) -> None:
        """Every field by its rule (`rules`: bounds by other fields included), then what reads a file
        or builds an object; a subclass extends this with checks of its own of that kind."""
        rules = type(self).rules()
        fields = [f.name for f in dataclasses.fields(self)]
        # the same lines as the torch-free schema's check (`centroidkv.schema.method_errors`)
        problems = param_errors(self.name, {name: getattr(self, name) for name in fields}, rules)
        if problems:
            raise ValueError(problems[0])

    def layer_budget(self, budget_len: int, layer_idx: int, n_layers: int) -> int:
        """Tokens this layer may keep; methods with per-layer budgets (PyramidKV) override it."""
        return budget_len

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        """Shrink the mergeable segment `kv` to exactly `target_len` tokens."""
        raise NotImplementedError

    def params(self) -> dict:
        """The parameters as runs record them: its fields, and its wrappers' (`centroidkv.wrapper`) at
        their defaults for this class, as a method built without them runs (`HeadPolicy.of`); a wrapped
        method (`get_method`'s) records its wrappers' own values instead."""
        return wrapped_defaults(type(self), dataclasses.asdict(self))

    @classmethod
    def default_params(cls) -> dict:
        """`params()` of the method built by `get_method` with its defaults, without building it (so
        without what its `validate` may import: the configuration's schema, `centroidkv.schema`)."""
        own = {name: copy.deepcopy(rule["default"]) for name, rule in field_rules(cls).items()}
        return wrapped_defaults(cls, own)


def check_int(method: Method, field: str, minimum: int) -> None:
    """Raise one clear ValueError unless the field is an integer (not a bool) >= `minimum`. For
    plug-ins' own checks; a field's simple rule is better declared with `param` (checked without torch)."""
    check_param(method.name, field, getattr(method, field), {"type": "int", "minimum": minimum})


def check_float(method: Method, field: str, low: float, high: float, low_open: bool = False) -> None:
    """Raise one clear ValueError unless `low <= value <= high` (or `low < value` when low_open); see
    `check_int`."""
    rule = {"type": "float", "minimum": low, "maximum": high, "low_open": low_open}
    check_param(method.name, field, getattr(method, field), rule)


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


def check_method_names(names: Iterable[str], option: str) -> None:
    """ValueError (one line naming every unknown one, after `option`) unless all of `names` are
    registered."""
    unknown = sorted(set(names) - set(method_names()))
    if unknown:
        raise ValueError(
            f"{option}: unknown method(s) {', '.join(unknown)}; choose from {', '.join(method_names())}"
        )


def method_class(name: str) -> type[Method]:
    """The registered class of `name`; ValueError (one line) for an unknown name."""
    _load_all()
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def method_label(name: str, params: dict[str, Any] | None = None) -> str:
    """The display label of a method run (its class's `label_for`, then what its wrappers add: " @int8");
    the bare name when unregistered."""
    try:
        cls = method_class(name)
    except ValueError:  # records of a method that is no longer installed keep their name
        return name
    params = dict(params or {})
    return cls.label_for(params) + label_suffix(params)


def method_variant(name: str, params: dict[str, Any] | None = None) -> str:
    """The default variant name of a method run (its class's `variant_for`, then what its wrappers add:
    "-int8"); the name when unregistered."""
    try:
        cls = method_class(name)
    except ValueError:
        return name
    params = dict(params or {})
    return cls.variant_for(params) + variant_suffix(params)


def get_method(name: str, **params) -> MethodWrapper:
    """Build a registered method with keyword parameters, inside every wrapper (`centroidkv.wrapper`:
    the head policy and the storage precision), each with its parameters; unknown names and parameters,
    and values against their rules, raise ValueError (one line, as the torch-free schema words it)."""
    cls = method_class(name)
    rules = cls.rules()
    in_order = {key: params[key] for key in rules if key in params} | params  # the first line: rules' order
    problems = param_errors(name, in_order, rules)
    if problems:
        raise ValueError(problems[0])
    fields = {f.name for f in dataclasses.fields(cls)}
    return wrap(cls(**{key: value for key, value in params.items() if key in fields}), params)


def parse_method(spec: str) -> MethodWrapper:
    """A method from its command-line form: `name`, `name:value` (the class's `shorthand` parameter,
    e.g. kvpress's press) or `name(key=value, ...)` with Python literals or bare words as values,
    e.g. `centroidkv(n_recent=32, heads=none)`. ValueError (one line) for anything else."""
    name, short, params = parse_method_spec(spec)  # the one parser (centroidkv.parsing)
    if short is not None:
        field_name = method_class(name).shorthand
        if field_name is None:
            raise ValueError(shorthand_error(spec, name))
        params = {field_name: short, **params}
    return get_method(name, **params)
