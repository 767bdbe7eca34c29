"""A method parameter's rule, declared once on its dataclass field and checked without torch.

A method (`centroidkv.methods.Method`) declares the simple rule of each parameter where the field is
defined: `n_recent: int = param(64, minimum=0)`, `schedule: str = param("adaptive", choices=SCHEDULES)`;
so does a wrapper of every method (`centroidkv.wrapper`: `heads: str = param("none", choices=...)`).
`Method.validate` checks every field by its rule (`param_errors`), and the configuration's schema
(`centroidkv.schema`) records the rules, so a configuration or a command line is checked before the
method modules (and torch) are imported. A rule may also bound a number by another parameter of the
same method (`r_min: float = param(0.1, at_most="r_init")`); checks that read a file or build an
object (a head file, a kvpress press's parameters) stay in the methods' `validate`.

A rule is a plain dict (JSON as it is): `type`, taken from the field's default (bool, int, float, str,
dict; bool is not an int, an int is a float), and any of `minimum`, `maximum`, `low_open`,
`high_open` (numbers), `parity` ("even" or "odd", integers), `power_of_two` (integers),
`choices` (a list of allowed values),
`at_most` (the name of a parameter this one must not exceed) and `reason` (why, shown in the
message). A subclass that redefines a field with a plain default keeps the rule of the field it
redefines (`field_rule` looks along the class's bases).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from collections.abc import Iterable
from typing import Any

from centroidkv.parsing import is_number

RULE_KEY = "centroidkv.rule"  # where a field's rule lives in its metadata
HINT_CUTOFF = 0.8  # difflib ratio above which a near-miss gets "did you mean ...?" (as for keys)


def param(
    default: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    parity: str | None = None,
    power_of_two: bool = False,
    choices: Iterable[Any] | None = None,
    at_most: str | None = None,
    reason: str | None = None,
) -> Any:
    """A dataclass field with `default` and a rule (module docstring): an integer >= minimum, a number
    in [minimum, maximum] (either end open; without a maximum, a finite number), an even or odd
    integer, a power of two, or one of `choices`; and at most the value of the parameter named `at_most`. `reason`
    says why, in the message."""
    if parity not in (None, "even", "odd"):
        raise ValueError(f"parity must be even or odd, got {parity!r}")
    rule: dict[str, Any] = {
        key: value
        for key, value in dict(
            minimum=minimum,
            maximum=maximum,
            low_open=low_open,
            high_open=high_open,
            parity=parity,
            power_of_two=power_of_two,
            at_most=at_most,
            reason=reason,
        ).items()
        if value is not None and value is not False  # 0 is a bound (0 == False)
    }
    if choices is not None:
        rule["choices"] = list(choices)
    metadata = {RULE_KEY: rule}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def type_of(default: Any) -> str | None:
    """The type a parameter's values must have, from its default (None: any value)."""
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("dict", dict)):
        if isinstance(default, types):
            return kind
    return None


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def field_rule(cls: type, field: dataclasses.Field) -> dict[str, Any]:
    """The rule of `cls`'s `field`: its own declared rule, else that of the nearest base class
    declaring one, with the field's default in `cls` (`default`) and that default's type (`type`)."""
    default = field_default(field)
    rule: dict[str, Any] = {}
    for klass in cls.__mro__:
        declared = vars(klass).get("__dataclass_fields__", {}).get(field.name)
        if declared is not None and RULE_KEY in declared.metadata:
            rule = dict(declared.metadata[RULE_KEY])
            break
    return {"default": default, "type": type_of(default), **rule}


def rule_set_apart(rule: dict[str, Any], declared: list[Any]) -> dict[str, Any]:
    """A parameter's `rule` (as `field_rule` gives it) for a class that sets it apart without a field
    of its own (a method's `wrapper_params`, `centroidkv.wrapper`): `declared` holds the entries of the
    class and its bases for it, the nearest first. As for a redefined field, the nearest entry gives
    the default (a plain value, or a `param`'s), the nearest `param` the rule; none: the rule stays."""
    if not declared:
        return rule
    nearest = declared[0]
    default = field_default(nearest) if isinstance(nearest, dataclasses.Field) else nearest
    ruled = [d for d in declared if isinstance(d, dataclasses.Field) and RULE_KEY in d.metadata]
    kept = (
        dict(ruled[0].metadata[RULE_KEY])
        if ruled
        else {k: v for k, v in rule.items() if k not in ("default", "type")}
    )
    return {"default": default, "type": type_of(default), **kept}


def field_rules(cls: type) -> dict[str, dict[str, Any]]:
    """Every parameter (init field) of a dataclass with its rule (`field_rule`), in field order."""
    return {f.name: field_rule(cls, f) for f in dataclasses.fields(cls) if f.init}


def closest(value: Any, choices: Iterable[Any]) -> str | None:
    """The choice closest to a mistyped `value` (difflib), or None when none is close."""
    if not isinstance(value, str):
        return None
    names = [str(choice) for choice in choices]
    found = difflib.get_close_matches(value, names, n=1, cutoff=HINT_CUTOFF)
    return found[0] if found else None


def did_you_mean(value: Any, choices: Iterable[Any]) -> str:
    """`; did you mean X?` for a near-miss of one of `choices`, else ""."""
    found = closest(value, choices)
    return f"; did you mean {found}?" if found is not None else ""


def _number(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def requirement(rule: dict[str, Any]) -> str:
    """What a value must be, in words ("an integer >= 0", "a number in (0.0, 1.0]", "one of a, b")."""
    if "choices" in rule:
        choices = rule["choices"]
        return str(choices[0]) if len(choices) == 1 else f"one of {', '.join(map(str, choices))}"
    kind = rule.get("type")
    low, high = rule.get("minimum"), rule.get("maximum")
    if kind == "int" and rule.get("power_of_two"):
        what = "a power of two"
    elif kind == "int":
        what = f"an {rule['parity']} integer" if rule.get("parity") else "an integer"
    elif kind == "float":
        what = "a number"
    elif kind == "bool":
        return "True or False"
    elif kind == "str":
        return "a string"
    elif kind == "dict":
        return "a mapping"
    else:
        return "a valid value"
    if low is not None and high is not None:
        left = "(" if rule.get("low_open") else "["
        right = ")" if rule.get("high_open") else "]"
        return f"{what} in {left}{_number(low)}, {_number(high)}{right}"
    if low is not None:
        return f"{what} {'>' if rule.get('low_open') else '>='} {_number(low)}"
    if high is not None:
        return f"{what} {'<' if rule.get('high_open') else '<='} {_number(high)}"
    return what


def rule_error(rule: dict[str, Any], value: Any) -> str | None:
    """What is wrong with `value` under `rule` ("must be ..., got ..."), or None when it passes."""
    reason = f" ({rule['reason']})" if rule.get("reason") else ""
    if "choices" in rule:
        try:
            ok = value in rule["choices"]
        except TypeError:  # an unhashable value against hashable choices
            ok = False
        if ok:
            return None
        return f"must be {requirement(rule)}{reason}, got {value!r}{did_you_mean(value, rule['choices'])}"
    kind = rule.get("type")
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, (str, os.PathLike)),
        "dict": isinstance(value, dict),
    }.get(kind, True)
    if ok and kind in ("int", "float"):
        low, high = rule.get("minimum"), rule.get("maximum")
        ok = not math.isnan(value) and (high is not None or math.isfinite(value))  # no maximum: finite
        if ok and low is not None:
            ok = value > low if rule.get("low_open") else value >= low
        if ok and high is not None:
            ok = value < high if rule.get("high_open") else value <= high
        if ok and kind == "int" and rule.get("parity"):
            if value % 2 != (0 if rule["parity"] == "even" else 1):
                return f"must be {rule['parity']}{reason}, got {value!r}"
        if ok and kind == "int" and rule.get("power_of_two") and (value < 1 or value & (value - 1)):
            return f"must be a power of two{reason}, got {value!r}"
    if ok:
        return None
    return f"must be {requirement(rule)}{reason}, got {value!r}"


def relation_errors(method_name: str, values: dict[str, Any], rules: dict[str, dict[str, Any]]) -> list[str]:
    """One line per `at_most` bound that `values` (every parameter's value) break; a value that is not
    a number is left to its own rule."""
    errors = []
    for key, rule in rules.items():
        other = rule.get("at_most")
        value, bound = values.get(key), values.get(other)
        if other is None or not all(is_number(v) for v in (value, bound)) or value <= bound:
            continue
        reason = f" ({rule['reason']})" if rule.get("reason") else ""
        errors.append(f"{method_name}: {key} ({value}) must not exceed {other} ({bound}){reason}")
    return errors


def check_param(method_name: str, field_name: str, value: Any, rule: dict[str, Any]) -> None:
    """Raise one ValueError line (`<method>: <field> must be ..., got ...`, with `did you mean X?` for
    a near-miss of a choice) unless `value` passes `rule`."""
    problem = rule_error(rule, value)
    if problem is not None:
        raise ValueError(f"{method_name}: {field_name} {problem}")


def unknown_params_error(method_name: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """The line for parameters a method does not have, naming the closest known ones."""
    unknown, known = sorted(unknown), sorted(known)
    hints = [found for name in unknown if (found := closest(name, known)) is not None]
    hint = f"; did you mean {' and '.join(hints)}?" if hints else ""
    return f"{method_name}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(known)}{hint}"


def param_errors(method_name: str, params: dict[str, Any], rules: dict[str, dict[str, Any]]) -> list[str]:
    """One line per given parameter that the method lacks (one line for all of them) or whose value
    breaks its rule, then per bound by another parameter that the given values (the others at their
    defaults) break; `rules` maps every parameter of the method to its rule (`field_rules`)."""
    unknown = [key for key in params if key not in rules]
    errors = [unknown_params_error(method_name, unknown, rules)] if unknown else []
    for key, value in params.items():
        if key in rules:
            problem = rule_error(rules[key], value)
            if problem is not None:
                errors.append(f"{method_name}: {key} {problem}")
    if not errors:
        values = {key: rule["default"] for key, rule in rules.items()} | params
        errors += relation_errors(method_name, values, rules)
    return errors
