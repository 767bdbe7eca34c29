"""Benchmarks, one home each in this folder, found by discovery: the `benchmark.*` config of a run.

A benchmark is a frozen dataclass whose fields are its parameters with their defaults (the only place
they live: Hydra's `benchmark=<name>` options are built from them by `eval.config.store_configs`). It
says what is wrong with its values (`validate`), builds its samples (`load`), scores a prediction
(`score`) and may say how its results are shown (`report`). Everything about a benchmark lives in its
home: one module here (`toy.py`, `niah.py`), or a package for a big one (`ruler/`, `longbench/`:
generator, constants, scorer). Adding one is one module here:

    @register_benchmark
    @dataclass(frozen=True)
    class MyBench(Benchmark):
        name = "mybench"
        tasks: tuple[str, ...] = ("a", "b")
        lengths: tuple[int, ...] = (4096,)

        def load(self, tokenizer) -> list[Sample]: ...
        def score(self, sample: Sample, prediction: str) -> float: ...

        @classmethod  # optional: without it, the default report titled "mybench"
        def report(cls) -> Report:
            return Report(title="My bench", task_labels={"a": "A", "b": "B"})

A sample is a dict with at least `task`, `length`, `input` (the user message), `answers` and
`max_new_tokens`; `context`/`question` (the context-only protocol), `answer_prefix`,
`use_chat_template`, `index`, `depth` are optional. Packages outside this repository register theirs
through the `centroidkv.benchmarks` entry-point group.

Reporting: `scripts/tables.py` and `scripts/figures.py` group records by their `benchmark` field and
ask `benchmark_report(name)` how to show each group; they never name a benchmark. A benchmark that
says nothing gets the default `Report`: a score table of its tasks x methods at each budget with the
average, the average per budget, the ranking, and the score-vs-budget and score-vs-KV figures.

Splits: every benchmark has `split` (`dev` or `test`, default `test`). A generated benchmark keeps the
two apart by seeding its random generators with `self.sample_seed(...)` (which starts with the
split's name) and drawing its needle values and keys with `split_index` (from the split's half of
their value space; the rule is there). A fixed published test set refuses `split=dev` in `validate`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar

from centroidkv.registry import Registry

Sample = dict[str, Any]

ENTRY_POINT_GROUP = "centroidkv.benchmarks"

# The splits a benchmark can draw: `dev` to choose a method's settings (and to calibrate it), `test` to
# report. Their position here is the parity of their half of every value space (`split_index`).
SPLITS: tuple[str, ...] = ("dev", "test")


def split_error(split: object) -> str | None:
    """What is wrong with `split` (one line), or None when it is one of SPLITS."""
    if isinstance(split, str) and split in SPLITS:
        return None
    return f"must be one of {', '.join(SPLITS)}, got {split!r}"


def check_split(split: str) -> None:
    """Raise ValueError (one line) unless `split` is one of SPLITS."""
    if (error := split_error(split)) is not None:
        raise ValueError(f"split: {error}")


def _parity(split: str) -> int:
    """0 for dev, 1 for test: the parity of the split's half of every value space."""
    check_split(split)
    return SPLITS.index(split)


def split_seed(split: str, *parts: object) -> str:
    """The seed string of a random generator of `split`: the split's name, then `parts` (e.g. the
    benchmark, the task, the seed, the sample index), joined by ":". No dev seed equals a test seed."""
    check_split(split)
    return ":".join([split, *map(str, parts)])


def split_index(rng: random.Random, n: int, split: str) -> int:
    """A uniform draw from `split`'s half of range(n): THE partition rule of the splits' value spaces.

    Every value space a generator draws needles from is numbered 0..n-1 (how RULER's are numbered is
    in `eval/benchmarks/ruler/needles.py`); dev takes the even numbers, test the odd ones. Within its half a
    split's draws are uniform, so the splits never share a value and each keeps the distribution of
    the whole space.
    """
    parity = _parity(split)
    return parity + 2 * rng.randrange((n - parity + 1) // 2)


def split_items(n: int, split: str) -> range:
    """The numbers of range(n) that belong to `split` (the same rule as `split_index`, enumerated)."""
    return range(_parity(split), n, 2)


@dataclass(frozen=True)
class Report:
    """How `scripts/tables.py` and `scripts/figures.py` show a benchmark's records.

    title: the name captions and figure titles give the benchmark (e.g. "RULER").
    task_labels: a column header per task, in the order the columns come; tasks not listed follow
        under their own names, sorted.
    families: task groups (name -> tasks) that get a panel each in a per-family score-vs-budget
        figure (drawn when the records hold tasks of two families or more).
    summary: a table of each method's average at every budget (when there are several budgets).
    ranking: a table of the ranking by average score with bootstrap intervals, per budget.
    heatmap: a depth x length heatmap per method and budget (records that carry a needle `depth`).
    """

    title: str
    task_labels: Mapping[str, str] = field(default_factory=dict)
    families: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    summary: bool = True
    ranking: bool = True
    heatmap: bool = False


@dataclass(frozen=True)
class Benchmark:
    """Parameters every benchmark has, and their checks.

    tasks: the benchmark's tasks (or datasets) to run.
    lengths: context lengths in tokens (what a length means is the benchmark's).
    n_samples: samples per task and length.
    seed: seed of generated samples.
    max_new_tokens: cap on the per-task generation length (None: the benchmark's own).
    context_only: compress the context only, then feed the question uncompressed.
    ignore_eos: decode exactly max_new_tokens (speed runs).
    split: "dev" (choosing settings, calibration) or "test" (reported results); their samples are
    disjoint (see `split_index`).
    """

    name: ClassVar[str] = "base"
    # True when a length is the sample's prompt + new tokens in tokens (the protected-window check
    # against the budget then runs at validation, before any model loads).
    length_is_tokens: ClassVar[bool] = False
    # Parameters that only choose which samples run (every record names the sample it holds: task,
    # length, depth, sample_id) or where they are read from, never what a sample scores: jobs that
    # differ only in them are one configuration in the tables (`scripts/tables.py`).
    sample_choice: ClassVar[frozenset[str]] = frozenset({"n_samples", "tasks", "lengths"})

    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    n_samples: int = 1
    seed: int = 0
    max_new_tokens: int | None = None
    context_only: bool = False
    ignore_eos: bool = False
    split: str = "test"

    # --- what a benchmark module provides ---------------------------------------------------
    def load(self, tokenizer) -> list[Sample]:
        """The samples, each with task, length, input, answers and max_new_tokens."""
        raise NotImplementedError

    def score(self, sample: Sample, prediction: str) -> float:
        """The benchmark's metric for one prediction, 0-100."""
        raise NotImplementedError

    def record_fields(self, sample: Sample, prediction: str, score: float) -> dict[str, Any]:
        """Fields a scored record carries besides its score (none by default)."""
        return {}

    def validate(self) -> list[str]:
        """One line per bad value (empty when all is well); subclasses extend it."""
        errors = []
        if not self.tasks:
            errors.append("benchmark.tasks: at least one task is needed")
        if not self.lengths:
            errors.append("benchmark.lengths: at least one context length is needed")
        for length in self.lengths:
            if not _is_int(length) or length < 16:
                errors.append(
                    f"benchmark.lengths: each length must be an integer >= 16 tokens, got {length!r}"
                )
        if not _is_int(self.n_samples) or self.n_samples < 1:
            errors.append(f"benchmark.n_samples: must be an integer >= 1, got {self.n_samples!r}")
        if not _is_int(self.seed) or self.seed < 0:
            errors.append(f"benchmark.seed: must be an integer >= 0, got {self.seed!r}")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            errors.append(
                f"benchmark.max_new_tokens: must be an integer >= 1 or null, got {self.max_new_tokens!r}"
            )
        for key in ("context_only", "ignore_eos"):
            if not isinstance(getattr(self, key), bool):
                errors.append(f"benchmark.{key}: must be true or false, got {getattr(self, key)!r}")
        if (error := split_error(self.split)) is not None:
            errors.append(f"benchmark.split: {error}")
        return errors

    @property
    def needs_hub(self) -> bool:
        """Whether loading the samples may reach the Hugging Face Hub."""
        return False

    def n_expected_samples(self) -> int:
        """How many samples `load` gives at most (for the results folder's space check)."""
        return len(self.tasks) * len(self.lengths) * self.n_samples

    @classmethod
    def report(cls) -> Report:
        """How the tables and figures show this benchmark's records (the default: titled by its name,
        tasks in name order, no families, average per budget and ranking, no heatmap)."""
        return Report(title=cls.name)

    # --- shared ---------------------------------------------------------------------------
    def sample_seed(self, *parts: object) -> str:
        """The seed string of a random generator of this benchmark's split and seed, e.g.
        `self.sample_seed(task, length)`; the same parts in the other split give another seed."""
        return split_seed(self.split, self.name, self.seed, *parts)

    def params(self) -> dict[str, Any]:
        """The parameters with the name, as plain values (lists for tuples): a config node."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"name": self.name, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}

    def samples(self, tokenizer) -> list[Sample]:
        """`load`'s samples interleaved across tasks and lengths (sample 0 of every task first), so
        that a job stopped early still covers every task."""
        samples = self.load(tokenizer)
        order = {key: i for i, key in enumerate(dict.fromkeys((s["task"], s.get("length")) for s in samples))}
        position: dict[tuple, int] = {}
        ranked = []
        for sample in samples:
            key = (sample["task"], sample.get("length"))
            position[key] = position.get(key, -1) + 1
            ranked.append((position[key], order[key], sample))
        return [sample for *_, sample in sorted(ranked, key=lambda item: item[:2])]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


REGISTRY: Registry[type[Benchmark]] = Registry("benchmark")


def register_benchmark(cls: type[Benchmark]) -> type[Benchmark]:
    """Class decorator: make a benchmark available as `benchmark=<cls.name>`; a name taken by another
    class is refused, as for methods (`centroidkv.registry.Registry`)."""
    return REGISTRY.register(cls)


def _discover() -> None:
    """Import every module of this package, then every `centroidkv.benchmarks` entry point."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()


def benchmark_names() -> list[str]:
    _discover()
    return sorted(REGISTRY)


def sample_choice_keys() -> frozenset[str]:
    """The identity keys (`benchmark.<parameter>`) of every registered benchmark's `sample_choice`."""
    _discover()
    return frozenset(f"benchmark.{key}" for cls in REGISTRY.values() for key in cls.sample_choice)


def benchmark_report(name: str) -> Report:
    """How to show the records of benchmark `name`: its class's `report()`, or the default `Report`
    titled by the name when no registered benchmark has it (records of a benchmark since removed)."""
    _discover()
    return REGISTRY[name].report() if name in REGISTRY else Report(title=name)


def build_benchmark(raw: dict[str, Any]) -> tuple[Benchmark | None, list[str]]:
    """The benchmark a `benchmark` config node describes, and one error line per bad value."""
    names = benchmark_names()
    name = raw.get("name")
    if name not in REGISTRY:
        return None, [f"benchmark.name: unknown benchmark {name!r}; choose one of {', '.join(names)}"]
    cls = REGISTRY[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors = [
        f"benchmark.{key}: {name} has no such parameter; its parameters: {', '.join(fields)}"
        for key in raw
        if key != "name" and key not in fields
    ]
    values = {}
    for key, value in raw.items():
        if key not in fields:
            continue
        if isinstance(fields[key].default, tuple):  # list parameters: a single value is a list of one
            value = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
        values[key] = value
    benchmark = cls(**values)
    return benchmark, errors + benchmark.validate()
