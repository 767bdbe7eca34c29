"""The machine's load while a record was timed: each record carries the 1-minute load average and the
core count (`machine_load`), and a table of timings says what the load was and warns when it
exceeded the cores (`load_note`): a TTFT twice another's may be the machine's, not the method's."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any


def machine_load() -> dict[str, Any]:
    """{"load_1min": the 1-minute load average (None where the OS has none), "n_cores": CPU count}."""
    try:
        load_1min: float | None = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load_1min = None
    return {"load_1min": load_1min, "n_cores": os.cpu_count()}


def load_note(records: Iterable[dict[str, Any]]) -> str:
    """The sentence a timing table's caption ends with: the highest 1-minute load on the fewest cores
    of the records, and a warning when it exceeded them; "" when no record has a load."""
    loads, cores = [], []
    for record in records:
        load, n_cores = record.get("load_1min"), record.get("n_cores")
        if isinstance(load, (int, float)) and not math.isnan(load):
            loads.append(float(load))
        if isinstance(n_cores, (int, float)) and not math.isnan(n_cores):
            cores.append(int(n_cores))
    if not loads:
        return ""
    highest, fewest = max(loads), (min(cores) if cores else None)
    note = f". Machine load (1-min average) while timed: up to {highest:.1f}" + (
        f" on {fewest} cores" if fewest else ""
    )
    if fewest and highest > fewest:
        note += ". Warning: the load exceeded the cores, so these timings are inflated and unequal"
    return note
