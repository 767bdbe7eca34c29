"""Splitting a command line's lists and reading its method specs without importing anything heavy."""

from __future__ import annotations

import ast
import math
import re
from numbers import Real
from typing import Any

# `name`, `name:value` or `name(key=value, ...)` (`parse_method_spec`)
METHOD_SPEC = re.compile(r"([A-Za-z0-9_.-]+)(?::(.+)|\((.*)\))?", flags=re.S)


def is_number(value: Any, finite: bool = False) -> bool:
    """Whether `value` is a real number (not a bool, not NaN); finite: not an infinity either."""
    if not isinstance(value, Real) or isinstance(value, bool) or value != value:
        return False
    return not finite or math.isfinite(value)


def split_top_level(text: str) -> list[str]:
    """`text` split at its top-level commas: not inside brackets or quotes (`a=1,b=[x,y]` -> `a=1`,
    `b=[x,y]`); empty items dropped."""
    items, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        current += char
    return [item for item in [*items, current] if item.strip()]


def parse_method_spec(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """A method's command-line form read without knowing the method: (name, the value of `name:value`
    or None, the keyword parameters of `name(key=value, ...)`, Python literals or bare words as values:
    `literal`). One ValueError line for anything else. The one parser of `centroidkv.methods.parse_method`
    (which builds the method) and `centroidkv.schema.check_method_spec` (which checks it without torch)."""
    spec = spec.strip()
    match = METHOD_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"method {spec!r}: write name, name:value or name(key=value, ...)")
    name, short, arguments = match.groups()
    params: dict[str, Any] = {}
    for item in split_top_level(arguments or ""):
        key, equals, value = item.partition("=")
        if not equals or not key.strip().isidentifier():
            raise ValueError(f"method {spec!r}: {item.strip()!r} is not key=value")
        params[key.strip()] = literal(value.strip())
    return name, None if short is None else short.strip(), params


def shorthand_error(spec: str, name: str) -> str:
    """The line for `name:value` of a method that has no shorthand parameter."""
    return f"method {spec.strip()!r}: {name} takes no name:value form; write {name}(key=value, ...)"


def literal(text: str) -> Any:
    """A Python literal (1, 0.5, True, "x", [1, 2]); true/false/null as YAML writes them; else the text
    (so `heads=none` is the word "none", as in the YAML configs)."""
    lowered = {"true": True, "false": False, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return text if value is None else value  # Python's None is not a YAML value: keep the word
