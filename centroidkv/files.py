"""Files, safely: the one atomic-write helper of the project, and a file test that cannot raise.

Every file the project replaces (records' metadata, head files, the cached schema, tables, figures)
goes through `replaced_atomically`: a temporary file created with O_EXCL in the same folder
(`tempfile.mkstemp`, so a planted name or symbolic link is never followed), renamed into place, so
readers see the old file or the whole new one. Torch-free.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """Yield a fresh temporary path beside `path` (created empty with O_EXCL, same suffix) to write
    to; on a clean exit it gets `mode` (mkstemp creates 0600) and replaces `path` in one rename; on
    any error it is removed and `path` is untouched."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f"{path.suffix}.tmp")
    os.close(fd)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` (UTF-8) to `path` atomically and durably (fsync before the rename)."""
    with replaced_atomically(path, mode) as temporary:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())


def is_file(value: str | os.PathLike) -> bool:
    """Whether `value` names an existing regular file. Never raises: a text too long to be a file
    name (ENAMETOOLONG), one with a NUL byte or an unreadable folder is simply not a file."""
    return os.path.isfile(value)


def file_problem(value: str | os.PathLike) -> str | None:
    """Why `value` cannot be read as a file ("no such file", "is a folder, not a file"), or None."""
    if os.path.isdir(value):
        return f"{value} is a folder, not a file"
    if not is_file(value):
        return f"no such file: {value}"
    return None


def read_file_text(value: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of the file `value`; a file that is not text (binary, another encoding) or cannot
    be read is one ValueError line naming `what` and the file."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what}: {value} is not UTF-8 text (byte {error.start}): {error.reason}") from None
    except OSError as error:
        raise ValueError(f"{what}: cannot read {value}: {error.strerror or error}") from None
