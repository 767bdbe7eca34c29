"""Reading a compact records file (`results/<experiment>.jsonl.gz`, written by
`scripts/compact_records.py export`), every line checked before anything is made of it.

A compact file may come from someone else's results: no field of it chooses where anything is
written (`experiment` and `job` must be plain folder names), and a line of the wrong shape or type
(not JSON, not an object, a number out of range, text where a number belongs) is one `CompactError`
line naming the file and the line. Torch-free: `python -m eval.results` reads these files too.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

from centroidkv.plan.measurements import table_measurements
from eval.records import NAME_MAX

FORMAT_VERSION = 1
SUFFIX = ".jsonl.gz"  # results/<experiment>.jsonl.gz: beside the (generated) experiment folders

# A record's experiment or job as a folder name: letters, digits, _ . + - (job names hold "+"), not
# "." or "..", at most NAME_MAX characters; so never an absolute path, a parent or a separator.
FOLDER_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
FOLDER_FIELDS = ("experiment", "job")
# The types the tables read each field as (a field may also be null, except the folder fields).
TEXT_FIELDS = ("benchmark", "task", "sample_id", "method", "variant", "model", "status", "split",
               "budget_unit", "protocol")  # fmt: skip
FLAG_FIELDS = ("kept_every_token", "kv_masked", "prefill_shared")
NUMBER_FIELDS = ("budget", "score", "length", "context_length", "depth", "n_cores", "load_1min",
                 "decode_batch", "kv_budget_ratio", "kv_final_ratio", "kv_allocated_ratio", "kv_ratio")  # fmt: skip


class CompactError(ValueError):
    """A compact records file that cannot be read as one; the message is one line."""


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def out_of_range(value: Any, where: str = "") -> str | None:
    """The path (`where`) of the first number in `value` (nested lists and objects included) that is
    not finite or exceeds a float (`1e400` reads as inf, `10**400` overflows the tables), else None."""
    if is_number(value):
        try:
            return None if math.isfinite(float(value)) else where or "the value"
        except OverflowError:
            return where or "the value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = out_of_range(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def folder_name_problem(value: Any) -> str | None:
    """Why `value` cannot name a folder under the one being written into, or None when it can."""
    if not isinstance(value, str) or not FOLDER_NAME.fullmatch(value) or value in (".", ".."):
        return f"must be a plain folder name (letters, digits, _ . + -; not . or ..), got {value!r:.80}"
    if len(value) > NAME_MAX:
        return f"has {len(value)} characters, more than a folder name may have ({NAME_MAX})"
    return None


def record_problem(record: Any) -> str | None:
    """What is wrong with one record line's value, in words, or None."""
    if not isinstance(record, dict):
        return f"a record must be a JSON object, got a JSON {type(record).__name__}"
    for name in FOLDER_FIELDS:
        problem = folder_name_problem(record.get(name))
        if problem:
            return f"{name} {problem}"
    numbers = (*NUMBER_FIELDS, *(m.name for m in table_measurements()))
    for names, fits, kind in ((TEXT_FIELDS, lambda v: isinstance(v, str), "text"),
                              (FLAG_FIELDS, lambda v: isinstance(v, bool), "true or false"),
                              (numbers, is_number, "a number"),
                              (("params",), lambda v: isinstance(v, dict), "an object")):  # fmt: skip
        for name in names:
            if record.get(name) is not None and not fits(record[name]):
                return f"{name} must be {kind}, got {record[name]!r:.60}"
    found = out_of_range(record)
    return f"{found} is not a finite number in range" if found else None


def header_problem(header: Any) -> str | None:
    """What is wrong with the first line (the file's header), in words, or None."""
    if not isinstance(header, dict) or header.get("compact") != FORMAT_VERSION:
        return f"not a compact records file (a first line with compact: {FORMAT_VERSION})"
    identities = header.get("identities")
    if not isinstance(identities, dict):
        return f"identities must be an object of experiment/job -> identity, got {identities!r:.60}"
    for job, identity in identities.items():
        if identity is not None and not isinstance(identity, dict):
            return f"identities[{job!r:.60}] must be an object or null, got {identity!r:.60}"
    cpus = header.get("cpus", [])
    if not isinstance(cpus, list) or not all(isinstance(cpu, str) for cpu in cpus):
        return f"cpus must be a list of CPU names, got {cpus!r:.60}"
    found = out_of_range(identities)
    return f"identities.{found} is not a finite number in range" if found else None


def _lines(compact: Path) -> list[tuple[int, str]]:
    """The file's non-blank lines with their numbers (from 1); CompactError when it is not gzip text."""
    try:
        with gzip.open(compact, "rt", encoding="utf-8") as handle:
            return [(number, line) for number, line in enumerate(handle, 1) if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as error:
        raise CompactError(f"{compact}: not a gzipped text file ({error})") from None


def read_compact(compact: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, records) of a compact file, every line checked (module docstring); CompactError, one
    line naming the file and the line, for the first line that is not what `export` writes."""
    parsed = []
    lines = _lines(compact)
    if not lines:
        raise CompactError(f"{compact}: empty, not a compact records file")
    for number, line in lines:
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise CompactError(f"{compact} line {number}: not JSON ({str(error)[:80]})") from None
        problem = header_problem(value) if not parsed else record_problem(value)
        if problem:
            raise CompactError(f"{compact} line {number}: {problem}")
        parsed.append(value)
    header, *records = parsed
    return header, records
