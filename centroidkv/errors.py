"""One line for an error: what the command lines, the job runner and failed records print."""

from __future__ import annotations


def first_line(error: BaseException, with_type: bool = False) -> str:
    """The first line of `error`'s message (surrounding blank space dropped), or its type's name when
    it has no message; with_type: `TypeName: first line` (nothing after the colon when it has none)."""
    lines = str(error).strip().splitlines()
    if with_type:
        return f"{type(error).__name__}: {lines[0] if lines else ''}"
    return lines[0] if lines else type(error).__name__
