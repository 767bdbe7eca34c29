"""What every decoded run measures, each quantity declared once under the name it has in a record.

A `Measurement` names a record field and says how to read it from a run: from its cache at one of
three moments (`COMPRESSED`: right after compression; `FED`: after the question was fed, before the
first decode step; `DECODED`: at the end) or from its times. `centroidkv.plan.decoding` reads every
registered measurement into `Fork.measured` / `Generation.measured`; the evaluation copies them into
the record under the same name; the job summary, W&B and the cost table of `scripts/tables.py`
iterate this registry. So a new per-record measurement is one `register_measurement(...)` call
(in the library or a plug-in) and nothing else: see `tests/test_measurements.py`.

    register_measurement(Measurement("kv_entries_total", "entries", DECODED,
                                     lambda run: sum(run.cache.seq_lengths())))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# When a measurement is read.
COMPRESSED = "compressed"  # right after the fork's compression, before the question (if any) is fed
FED = "fed"  # after the fed question: what decoding starts from
DECODED = "decoded"  # after the last decode step
MOMENTS = (COMPRESSED, FED, DECODED)


@dataclass
class RunState:
    """What a measurement may read: the run's cache, its times, and the memory peak of its decoding.

    `step_s`: the time of each decode step; `timed`: whether those steps were the run's own (False
    when forks decoded as the rows of one batch shared them)."""

    cache: Any  # centroidkv.cache.cache.CompressedCache
    prefill_s: float = 0.0
    compress_s: float = 0.0
    feed_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    timed: bool = True
    peak: tuple[int, str] | None = None  # (bytes, kind) of the decoding alone; None when batched


@dataclass(frozen=True)
class Measurement:
    """One per-record measurement: its record field `name`, the table column `title` (values times
    `scale`, e.g. bytes to MiB), when it is read, and how. `read` returns a number, a string or None
    (not measurable for this run, e.g. the TPOT of a batched fork)."""

    name: str
    title: str
    moment: str
    read: Callable[[RunState], Any]
    scale: float = 1.0
    in_table: bool = True  # a column of the cost table (and a W&B metric and summary mean)

    def __post_init__(self) -> None:
        if self.moment not in MOMENTS:
            raise ValueError(f"measurement {self.name}: moment must be one of {', '.join(MOMENTS)}")


MEASUREMENTS: dict[str, Measurement] = {}


def _kept_every_token(cache) -> bool | None:
    """Whether a compressing method's cache holds every token it has seen in every layer (None for the
    full cache, which always does)."""
    if not cache.method.compresses or not cache.layers:
        return None
    return all(layer.main.length == layer.get_seq_length() for layer in cache.layers)


def register_measurement(measurement: Measurement) -> Measurement:
    """Add a measurement to every record from now on; a name taken by another one is refused."""
    existing = MEASUREMENTS.get(measurement.name)
    if existing is not None and existing != measurement:
        raise ValueError(f"measurement name {measurement.name!r} is taken; choose another name")
    MEASUREMENTS[measurement.name] = measurement
    return measurement


def measure(moment: str, state: RunState) -> dict[str, Any]:
    """Every registered measurement of `moment`, read from `state`, by record field."""
    return {m.name: m.read(state) for m in MEASUREMENTS.values() if m.moment == moment}


def table_measurements() -> list[Measurement]:
    """The numeric measurements a cost table, a summary and W&B show, in registration order."""
    return [m for m in MEASUREMENTS.values() if m.in_table]


def _number_or_none(value: float) -> float | None:
    return None if value != value else value  # nan: not measured


def _tpot(run: RunState) -> float | None:
    """Mean decode step after the first (a warm-up when there are more); None when not the run's own."""
    after_first = run.step_s[1:] or run.step_s
    return sum(after_first) / len(after_first) if run.timed and after_first else None


for _measurement in (
    Measurement("tpot", "TPOT ms", DECODED, _tpot, scale=1000.0),
    Measurement("ttft", "TTFT s", FED, lambda run: run.prefill_s + run.compress_s + run.feed_s),
    Measurement("prefill_s", "prefill s", FED, lambda run: run.prefill_s, in_table=False),
    Measurement("compress_s", "compress s", FED, lambda run: run.compress_s, in_table=False),
    Measurement("feed_s", "feed s", FED, lambda run: run.feed_s, in_table=False),
    Measurement(
        "decode_s", "decode s", DECODED, lambda run: sum(run.step_s) if run.timed else None, in_table=False
    ),
    Measurement("n_decode_steps", "steps", DECODED, lambda run: len(run.step_s), in_table=False),
    # kv_budget_ratio: bytes stored right after compression / bytes of a full cache of n + Gamma tokens
    Measurement(
        "kv_budget_ratio", "KV/budget", COMPRESSED, lambda run: run.cache.budget_ratio(), in_table=False
    ),
    # kv_allocated_ratio: the same moment, the buffers allocated (decode headroom included) / that reference
    Measurement(
        "kv_allocated_ratio",
        "allocated/budget",
        COMPRESSED,
        lambda run: _number_or_none(run.cache.allocated_ratio()),
        in_table=False,
    ),
    # kv_bytes: what decoding starts from; kv_ratio: that over a full cache of the same tokens;
    # kv_bytes_final: what it ends holding (a packed store's bytes fall as its residual packs), both
    # in the cost table so that two storages are compared on what they held, not only where they began
    Measurement("kv_bytes", "KV MiB", FED, lambda run: run.cache.kv_bytes(), scale=2**-20),
    Measurement("kv_ratio", "KV ratio", FED, lambda run: run.cache.kv_ratio(), in_table=False),
    Measurement(
        "kv_bytes_final",
        "KV MiB end",
        DECODED,
        lambda run: run.cache.kv_bytes(),
        scale=2**-20,
    ),
    # what the cache holds at the end over the same reference as kv_budget_ratio: a packed store's
    # bytes fall when its residual is packed, and this says what it really held
    Measurement(
        "kv_final_ratio", "KV/budget end", DECODED, lambda run: run.cache.budget_ratio(), in_table=False
    ),
    # True when a compressing method ended holding every token it saw: its budget was more than its
    # storage could spend (e.g. int4 at R = 0.25 of a float32 reference), so R bought no compression
    Measurement(
        "kept_every_token", "kept all", DECODED, lambda run: _kept_every_token(run.cache), in_table=False
    ),
    Measurement(
        "kv_len", "entries", DECODED, lambda run: max(run.cache.seq_lengths(), default=0), in_table=False
    ),
    Measurement(
        "n_compressions", "compressions", DECODED, lambda run: run.cache.n_compressions, in_table=False
    ),
    # the protected windows the compressions kept, fewest over layers: the method's n_sink / n_recent
    # unless a prompt too short for them at the budget shrank them (`centroidkv.cache.budget.fit_protected`);
    # None without a compression
    Measurement(
        "n_sink_used", "sinks", DECODED, lambda run: run.cache.protected_used()["n_sink_used"], in_table=False
    ),
    Measurement(
        "n_recent_used",
        "recent",
        DECODED,
        lambda run: run.cache.protected_used()["n_recent_used"],
        in_table=False,
    ),
    Measurement(
        "peak_mem",
        "peak MiB",
        DECODED,
        lambda run: run.peak[0] if run.peak else None,
        scale=2**-20,
        in_table=False,
    ),
    Measurement(
        "peak_mem_kind", "peak kind", DECODED, lambda run: run.peak[1] if run.peak else None, in_table=False
    ),
):
    register_measurement(_measurement)
