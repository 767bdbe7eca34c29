"""One line for an error: what the command lines, the job runner and failed records print."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager


def first_line(error: BaseException, with_type: bool = False) -> str:
    """The first line of `error`'s message (surrounding blank space dropped), or its type's name when
    it has no message; with_type: `TypeName: first line` (nothing after the colon when it has none)."""
    lines = str(error).strip().splitlines()
    if with_type:
        return f"{type(error).__name__}: {lines[0] if lines else ''}"
    return lines[0] if lines else type(error).__name__


@contextmanager
def refused_in_one_line(parser: argparse.ArgumentParser) -> Iterator[None]:
    """`with refused_in_one_line(parser): <checks>`: a ValueError raised by the checks (run before a
    command line loads any model) ends the program with one line on stderr and exit status 2, as
    argparse does for the arguments it checks itself."""
    try:
        yield
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {first_line(error)}\n")
