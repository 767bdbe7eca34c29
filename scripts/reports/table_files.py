"""Where tables and figures are written: plain file names only, never through a symbolic link, each
file written atomically. A results folder from elsewhere never chooses where anything is written."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.records import ResultsWriteError, atomic_write  # noqa: E402


class OutputError(RuntimeError):
    """A table or figure file cannot be written; the message is one line."""


# A name from the records (an experiment, a benchmark) used as it is in a file name.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")


def safe_name(text: object) -> str:
    """`text` as part of a file name. A plain name (letters, digits, _ . -, not starting with a dot, at
    most 100 characters) is kept; any other is reduced to its plain runs joined by "_" (at most 60
    characters) and 8 hex digits of its hash, so that two names never reduce to the same one:
    "../../x/PWNED" -> "x_PWNED-<hash>". Records name their experiment and benchmark themselves, so a
    results folder from elsewhere never chooses where a table or figure is written."""
    text = str(text)
    if PLAIN_NAME.fullmatch(text):
        return text
    plain = "_".join(re.findall(r"[A-Za-z0-9_-]+", text))[:60]
    digest = hashlib.sha256(text.encode(errors="replace")).hexdigest()[:8]
    return f"{plain}-{digest}" if plain else digest


def output_folder(out: Path) -> Path:
    """`out`, created when missing, unless it is a symbolic link: tables and figures are never written
    through one (a link named like the folder may point anywhere)."""
    if out.is_symlink():
        raise OutputError(
            f"error: {out} is a symbolic link; not writing through it (remove it or give another --out)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"error: cannot create {out}: {error.strerror or error}") from None
    return out


def output_path(out: Path, name: str) -> Path:
    """`out / name`, once checked: not a symbolic link, and, resolved, a file directly in `out`."""
    path = writable_destination(out / name)
    if path.resolve().parent != out.resolve():
        raise OutputError(f"error: {name!r} is not a plain file name in {out}; not writing it")
    return path


def writable_destination(path: Path) -> Path:
    """`path`, unless it is a symbolic link: an output is never written through one (it may point
    anywhere, e.g. at a results file), and replacing the link would silently break it."""
    if path.is_symlink():
        raise OutputError(
            f"error: {path} is a symbolic link; not writing through it (remove it or use --out)"
        )
    return path


def write_text(path: Path, text: str) -> None:
    """Write `text` atomically (a temporary file in the same folder, renamed into place): a killed
    run leaves the old file or the new one, never a cut one."""
    try:
        atomic_write(output_path(path.parent, path.name), text)
    except ResultsWriteError as error:
        raise OutputError(f"error: {error}") from None
