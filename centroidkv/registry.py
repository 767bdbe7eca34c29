"""One registry type for everything found by name: methods (`centroidkv.methods`) and benchmarks
(`eval.benchmarks`).

A `Registry` maps a class's `name` to the class, filled by a class decorator (`registry.register`).
A name taken by a different class (by module and qualified name) is refused with one line naming
both; registering the same class again (a module imported twice) is allowed. It is a dict otherwise:
look-ups, `in`, iteration in registration order, and tests' `pop`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

# The entry-point group under which distributions declare method modules (read without torch).
METHOD_ENTRY_POINTS = "centroidkv.methods"

T = TypeVar("T", bound=type)


def qualified_name(cls: type) -> str:
    """`module.QualifiedName` of a class: what tells two classes of one name apart."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry(dict[str, T], Generic[T]):
    """Classes of one `kind` ("method", "benchmark") by their `name` attribute."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, cls: T) -> T:
        """Class decorator: add `cls` under `cls.name`; ValueError (one line) when the name is taken
        by another class."""
        name = cls.name
        existing = self.get(name)
        if existing is not None and qualified_name(existing) != qualified_name(cls):
            raise ValueError(
                f"{self.kind} name {name!r} is taken by {qualified_name(existing)}; "
                f"{qualified_name(cls)} needs another name"
            )
        self[name] = cls
        return cls
