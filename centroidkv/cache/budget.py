"""What a budget R means: entries per layer (the paper's accounting) or bytes (equal memory).

Both units start from one reference, a full cache of n + Gamma tokens (n the prompt, Gamma the
maximum number of new tokens):

- `entries`: every layer keeps B = R * (n + Gamma) entries per compressed KV head (`budget_entries`).
  What a method stores besides keys and values (log-degrees, positions, accumulated attention, KV
  heads kept whole) comes on top, so two methods at one R may store different bytes.
- `bytes` (the default): the entries per layer are solved so that everything the cache stores
  (`CompressedCache.kv_bytes()`) equals R times the bytes of that full cache, to within one entry per
  layer (`solve_entries`). A method that stores more per entry, or keeps heads whole, pays for it by
  keeping fewer entries in its compressed heads; methods that store keys and values only keep
  exactly B entries under both units.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from centroidkv.params import did_you_mean

BUDGET_UNITS = ("bytes", "entries")
DEFAULT_BUDGET_UNIT = "bytes"
RECORD_BYTES = 4  # every per-entry record (log-degree, position, attention sum) is one float32


def budget_entries(ratio: float, prompt_len: int, max_new_tokens: int) -> int:
    """B = R * (n + Gamma): the entries a layer keeps in the paper's accounting."""
    return int(ratio * (prompt_len + max_new_tokens))


def check_budget(budget: object) -> float:
    """The budget R as a float; one ValueError line unless it is a fraction in (0, 1] (checked here for
    every caller: the cache, `generate`, the run configuration)."""
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float))
        or math.isnan(budget)
        or not 0 < budget <= 1
    ):
        raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
    return float(budget)


def check_budget_unit(unit: str) -> None:
    if unit not in BUDGET_UNITS:
        raise ValueError(
            f"budget_unit: must be one of {', '.join(BUDGET_UNITS)}, got {unit!r}{did_you_mean(unit, BUDGET_UNITS)}"
        )


def solve_entries(
    stored_bytes: Callable[[int], int],
    target_bytes: int,
    upper: int,
    besides: tuple[str, str] = ("heads kept whole", "keep fewer heads whole"),
) -> int:
    """The largest entry count B in [0, upper] with stored_bytes(B) <= target_bytes.

    `stored_bytes` must be non-decreasing in B (it is: more entries never store less). Raises
    ValueError when even B = 0 stores more than the target, naming `besides`: (what is stored besides
    the compressed entries, what would lower it).
    """
    if stored_bytes(0) > target_bytes:
        what, remedy = besides
        remedies = ", ".join(part for part in ("raise the budget", remedy) if part)
        raise ValueError(
            f"a byte budget of {target_bytes} bytes cannot be met: what is stored besides the compressed "
            f"entries ({what}) already takes {stored_bytes(0)} bytes; {remedies}, or use "
            "budget_unit=entries"
        )
    low, high = 0, upper  # invariant: stored_bytes(low) <= target
    while low < high:
        middle = (low + high + 1) // 2
        if stored_bytes(middle) <= target_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def protected_entries(n_sink: int, n_recent: int) -> int:
    """The fewest entries a compressed head can be given: its protected first `n_sink` and last
    `n_recent` tokens, and one more for the method to choose."""
    return n_sink + n_recent + 1


def check_protected_fit(
    entries: int,
    n_sink: int,
    n_recent: int,
    what: str,
    remedy: str = "raise the budget or lower n_sink/n_recent",
) -> None:
    """Raise one ValueError line when `entries` per compressed head cannot hold the protected tokens
    (`protected_entries`). `what` names what keeps them (a method at a budget, a configuration),
    `remedy` what to change. The cache checks each compression; configurations are checked with it
    before a model loads."""
    protected = protected_entries(n_sink, n_recent)
    if entries < protected:
        raise ValueError(
            f"{what} keeps {entries} entries, fewer than its {protected} protected (n_sink {n_sink} + "
            f"n_recent {n_recent} + 1); {remedy}"
        )


def fit_protected(entries: int, n_sink: int, n_recent: int, what: str) -> tuple[int, int]:
    """The protected windows (n_sink, n_recent) a compressed head of `entries` entries keeps: the
    method's own when they fit with one entry left for the method to choose (`protected_entries`);
    for a prompt too short for them at the budget, the recent window shrinks to what the budget
    leaves, then the sinks, so that the budget is kept and the method still chooses at least one entry.
    The cache applies this rule at every compression and records what it used
    (`CompressedCache.protected_used`). Raises one ValueError line only when `entries` < 1 (`what`
    names what keeps them, e.g. a method at a budget): there is then no entry to keep at all."""
    if entries < 1:
        raise ValueError(f"{what} keeps {entries} entries: no room for any token; raise the budget")
    room = entries - 1  # one entry at least for the method to choose
    sink = min(n_sink, room)
    return sink, min(n_recent, room - sink)
