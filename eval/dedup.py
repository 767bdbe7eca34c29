"""One count per sample: the same sample × method × budget × configuration found in two jobs (two
runs of one command under other job names, a sweep that overlaps another) of one experiment is
counted once, so that
n agrees in tables, figures and rankings."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from eval.records import record_key


def _job_of(record: dict[str, Any]) -> str:
    return f"{record.get('experiment')}/{record.get('job')}"


def drop_repeated_records(
    records: Iterable[dict[str, Any]], configuration: Callable[[dict[str, Any]], Any]
) -> list[dict[str, Any]]:
    """`records` with each (record key, experiment, model, `configuration(record)`) kept once: the
    first found wins (records come in sorted file order); experiments are tabled apart, so each keeps
    its own. One line on stderr per pair of jobs that repeat each
    other, naming both and how many records were dropped."""
    kept: list[dict[str, Any]] = []
    first_job: dict[str, str] = {}
    repeated: Counter[tuple[str, str]] = Counter()
    for record in records:
        key = json.dumps(
            [record_key(record), record.get("experiment"), record.get("model"), configuration(record)],
            sort_keys=True,
            default=str,
        )
        if key in first_job:
            repeated[first_job[key], _job_of(record)] += 1
            continue
        first_job[key] = _job_of(record)
        kept.append(record)
    for (first, again), count in sorted(repeated.items()):
        print(
            f"[records] {again}: {count} record(s) repeat {first}'s (same sample, method, budget and "
            "configuration): counted once",
            file=sys.stderr,
        )
    return kept
