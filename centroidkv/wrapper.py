"""What wraps a method: a concern that every method takes and none declares (kvpress composes such
concerns the same way: `AdaKVPress(press)`, transformers' `QuantizedCache`).

A wrapper holds a method (`method`, which may be wrapped already) and its own parameters, declared as
dataclass fields with their rules (`centroidkv.params.param`), and stands for the method everywhere
else: what the wrapper does not hold is the wrapped method's (`__getattr__`), so a wrapped method
compresses, budgets, needs and names itself as the method does. `get_method` wraps every method it
builds in every registered wrapper (`register_wrapper`), innermost first by `depth`: the storage
precision (`centroidkv.storage_precision`), then the head policy (`centroidkv.head_policy`). So any
method takes `kv_precision=` and `heads=`, and a consumer asks for the concern by its class
(`HeadPolicy.of(method)`), never for a method's field.

A method sets a wrapper's parameters apart in its class's `wrapper_params`, as a subclass redefines a
field: a plain value is another default under the wrapper's rule, a `param(...)` another rule with its
reason (DuoAttention takes heads="whole" only). The method's `rules()`, and so the torch-free schema
(`centroidkv.schema`), hold them: a configuration is checked against them before torch loads.

A run records (`params()`) the parameters every method shares (those of `Method` itself), then each
wrapper's, outermost first, then the method's own: the order of the days when the wrappers'
parameters were fields of `Method`. A wrapper records only what decides a run's numbers (`recorded`;
the storage precision records nothing in the model's dtype), so a run keeps its identity.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from centroidkv.params import field_rule, param_errors, rule_set_apart
from centroidkv.registry import qualified_name

WRAPPERS: list[type[MethodWrapper]] = []  # innermost first (`depth`)


@dataclass
class MethodWrapper:
    """Base class: a method (`method`) with the parameters of one concern (module docstring).

    A subclass declares its parameters as dataclass fields with `param`, its `depth`, and the
    behaviour of its concern; `recorded`, `label_suffix` and `variant_suffix` say what a run's record,
    label and variant name show of it."""

    depth: ClassVar[int] = 0  # where it sits around a method: a smaller depth wraps it first

    method: Any  # the wrapped method: a `centroidkv.methods.Method`, or a wrapper of one

    def __post_init__(self) -> None:
        self.validate()

    def __getattr__(self, name: str) -> Any:
        """What the wrapper does not hold is the wrapped method's (Python asks only after the usual
        look-up failed)."""
        if name == "method" or name.startswith("__"):  # half built (a copy, an unpickling): no method yet
            raise AttributeError(name)
        return getattr(self.method, name)

    @classmethod
    def parameter_names(cls) -> list[str]:
        """Its parameters, in field order."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "method"]

    @classmethod
    def rules_for(cls, method_class: type) -> dict[str, dict[str, Any]]:
        """Each of its parameters' rule for a method of `method_class`: the field's own, unless the
        class or a base sets it apart in `wrapper_params` (module docstring; `rule_set_apart`)."""
        rules = {}
        for field in dataclasses.fields(cls):
            if field.name != "method":
                declared = [
                    vars(klass)["wrapper_params"][field.name]
                    for klass in method_class.__mro__
                    if field.name in vars(klass).get("wrapper_params", {})
                ]
                rules[field.name] = rule_set_apart(field_rule(cls, field), declared)
        return rules

    @classmethod
    def recorded(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Its parameters as a run records them (`values`: every one of them): all of them here."""
        return values

    @classmethod
    def label_suffix(cls, params: dict[str, Any]) -> str:
        """What a run's display label adds for this concern (`params`: the run's recorded ones)."""
        return ""

    @classmethod
    def variant_suffix(cls, params: dict[str, Any]) -> str:
        """What a run's default variant name adds for this concern."""
        return ""

    @classmethod
    def around(cls, method: Any, params: dict[str, Any]) -> MethodWrapper:
        """This wrapper around `method` with its parameters from `params`, the others at their defaults
        for the method's class (`rules_for`: CentroidKV's head policy is heads="whole")."""
        rules = cls.rules_for(type(innermost(method)))
        values = {
            name: params[name] if name in params else copy.deepcopy(rule["default"])
            for name, rule in rules.items()
        }
        return cls(method, **values)

    @classmethod
    def of(cls, method: Any) -> MethodWrapper:
        """This concern of `method`: its wrapper of this class, or for a method built without one (not
        by `get_method`) this wrapper at the method's defaults."""
        inner = method
        while isinstance(inner, MethodWrapper):
            if isinstance(inner, cls):
                return inner
            inner = inner.method
        return cls.around(method, {})

    def wrapper_values(self) -> dict[str, Any]:
        """Its parameters' values."""
        return {name: getattr(self, name) for name in self.parameter_names()}

    def params(self) -> dict[str, Any]:
        """The wrapped method's parameters with this wrapper's own as it records them (module docstring)."""
        inner = {
            name: value for name, value in self.method.params().items() if name not in self.parameter_names()
        }
        return record_order(inner | self.recorded(self.wrapper_values()), type(innermost(self)))

    def validate(self) -> None:
        """Every parameter by its rule for the wrapped method's class (`rules_for`); a subclass extends
        this with checks that read a file."""
        rules = self.rules_for(type(innermost(self)))
        problems = param_errors(self.method.name, self.wrapper_values(), rules)
        if problems:
            raise ValueError(problems[0])


def register_wrapper(cls: type[MethodWrapper]) -> type[MethodWrapper]:
    """Class decorator: wrap every method `get_method` builds in `cls` too, at its `depth` (a class
    registered again, its module imported twice, takes its old place)."""
    WRAPPERS[:] = [w for w in WRAPPERS if qualified_name(w) != qualified_name(cls)] + [cls]
    WRAPPERS.sort(key=lambda w: w.depth)
    return cls


def innermost(method: Any) -> Any:
    """The method inside every wrapper of `method` (itself when it is not wrapped)."""
    while isinstance(method, MethodWrapper):
        method = method.method
    return method


def wrap(method: Any, params: dict[str, Any]) -> Any:
    """`method` inside every registered wrapper, each with its parameters from `params` (the others at
    their defaults for the method's class)."""
    for wrapper in list(WRAPPERS):
        method = wrapper.around(method, params)
    return method


def shared_params(method_class: type) -> list[str]:
    """The parameters every method shares: the fields of the first dataclass among its bases
    (`centroidkv.methods.Method`)."""
    root = [klass for klass in method_class.__mro__ if dataclasses.is_dataclass(klass)][-1]
    return [f.name for f in dataclasses.fields(root)]


def record_order(params: dict[str, Any], method_class: type) -> dict[str, Any]:
    """A method's `params` (or rules) in the order runs record them (module docstring): the shared
    ones, each wrapper's (outermost first), then the method's own."""
    first = [*shared_params(method_class), *(n for w in reversed(WRAPPERS) for n in w.parameter_names())]
    ordered = {name: params[name] for name in first if name in params}
    return ordered | {name: value for name, value in params.items() if name not in first}


def wrapped_rules(method_class: type, own: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every parameter's rule of a method of `method_class` as `get_method` builds it: its own (`own`,
    its fields') and its wrappers'."""
    rules = dict(own)
    for wrapper in WRAPPERS:
        rules |= wrapper.rules_for(method_class)
    return record_order(rules, method_class)


def wrapped_defaults(method_class: type, own: dict[str, Any]) -> dict[str, Any]:
    """What a method of `method_class` records with its own parameters `own` and its wrappers at their
    defaults for it (as they record them): a bare method's `params()`, and `default_params()`."""
    values = dict(own)
    for wrapper in WRAPPERS:
        rules = wrapper.rules_for(method_class)
        values |= wrapper.recorded({name: copy.deepcopy(rule["default"]) for name, rule in rules.items()})
    return record_order(values, method_class)


def label_suffix(params: dict[str, Any]) -> str:
    """What a run's display label adds for its wrappers (" @int8": `centroidkv.storage_precision`)."""
    return "".join(wrapper.label_suffix(params) for wrapper in WRAPPERS)


def variant_suffix(params: dict[str, Any]) -> str:
    """What a run's default variant name adds for its wrappers ("-int8")."""
    return "".join(wrapper.variant_suffix(params) for wrapper in WRAPPERS)
