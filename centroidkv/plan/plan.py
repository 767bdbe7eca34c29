"""One plan per prompt: every (method, budget) run of one prompt, from as few prefills as possible.

`run(model, prompt, runs, ...)` is the one place that decides, for one prompt:

1. which prefill each run starts from. A native method forks one shared prefill of the prompt that
   recorded what every native run needs (`centroidkv.needs`). A method that compresses inside a
   prefill forward instead (a `PrefillCompressor` of `centroidkv.plan.prefill_compressor`: a bridge to
   another library's prefill hooks) hands back a per-run object (`PrefillRun`); with
   `share_prefill`, that object compresses its own fork of a prefill of the context layer by layer
   (`centroidkv.plan.decoding.PrefillTap`), else it gets a prefill of its own with its hooks active.
   One forward serves natives and taps when both prefill the same tokens and nothing the natives record changes the attention's arithmetic;
2. how the forks decode: up to `decode_batch` of them as the rows of one batch (one weight pass per
   step), a run whose decoding hooks change the model (masks on the attention modules) alone;
3. what a failure costs: a batch that fails starts each of its forks again from its own source and
   decodes it alone, so one fork's failure stays its own; a run that fails keeps its error.

It returns one `Outcome` per run, in order. A prefill compressor always runs the context-only
protocol (context prefilled and compressed, question fed afterwards); the natives run the prompt as
given (`Prompt.protocol`). A context-only prompt may carry further questions (`Prompt.follow_ups`):
each run compresses the context once and answers every question from a fork of that compressed
cache, as kvpress's pipeline does with `questions=[...]` (one outcome per run and question).
`centroidkv.plan.generate`, `warm_up` and the harness's per-sample evaluation all call `run`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn

from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS
from centroidkv.plan.decoding import (
    Fork,
    Generation,
    Prefill,
    decode_forks,
    default_eos,
    needs_of,
    prefill,
    start_fork,
)
from centroidkv.plan.measurements import COMPRESSED, RunState, measure
from centroidkv.plan.prefill_compressor import PrefillRun, compresses_in_prefill
from centroidkv.plan.prefill_store import PrefillStore, stored_prefill
from centroidkv.plan.run_options import CONTEXT_ONLY, DEFAULT_DECODE_BATCH, FULL_PROMPT, check_decode_batch
from centroidkv.plan.timing import Timer


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, split as the call's protocol prefills and feeds them (`prefilled`, then
    `fed` after compression; `fed` is empty under the full-prompt protocol) and split context-only
    (`context`, `question`), which prefill compressors always use and nothing else reads (a caller
    with no prefill compressor among its runs may leave them empty)."""

    prefilled: list[int]
    fed: list[int]
    context: list[int]
    question: list[int]
    protocol: str = FULL_PROMPT  # the protocol of (prefilled, fed)
    # Further questions about the same context (context-only only), each answered from the same
    # compressed cache as `question`: ids as `question` holds them (the question's turn of the chat).
    follow_ups: tuple[list[int], ...] = ()

    @property
    def n_questions(self) -> int:
        return 1 + len(self.follow_ups)

    def question_ids(self, question: int) -> list[int]:
        """What a prefill compressor feeds after the context, for question `question` (0: `question`)."""
        return self.question if question == 0 else self.follow_ups[question - 1]

    def fed_ids(self, question: int) -> list[int]:
        """What a native run feeds after compressing, for question `question`: `fed` for the first;
        a follow-up (context-only, where `fed` is `question`) as `question_ids` gives it."""
        return self.fed if question == 0 else self.question_ids(question)


@dataclass(frozen=True)
class Run:
    """One method at one budget (R), in `budget_unit` (None: the default unit, `centroidkv.cache.budget`)."""

    method: Method
    budget: float

    @classmethod
    def at(cls, method: Method, budget: float) -> Run:  # the full cache keeps every entry: R = 1
        return cls(method, budget if method.compresses else 1.0)


@dataclass
class Outcome:
    """A run's result for one question: its generation or its error, the protocol it ran, and its
    record fields (`prefill_shared`, `decode_batch`, a prefill compressor's own). `question`: which
    of the prompt's questions it answers (0: `Prompt.question`, k: `Prompt.follow_ups[k - 1]`).
    `answer_ids`: the first row's generated ids without a final end-of-sequence token (the text a
    benchmark scores)."""

    protocol: str
    question: int = 0
    fields: dict[str, Any] = field(default_factory=dict)
    generation: Generation | None = None
    error: BaseException | None = None
    answer_ids: list[int] = field(default_factory=list)


def run(
    model: nn.Module,
    prompt: Prompt,
    runs: Sequence[Run],
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    budget_unit: str | None = None,
    share_prefill: bool = True,
    decode_batch: int = DEFAULT_DECODE_BATCH,
    on_outcome: Callable[[int, Outcome], None] | None = None,
    prefill_store: PrefillStore | None = None,
) -> list[Outcome]:
    """Every run of `runs` on `prompt`, greedy, `max_new_tokens` at most, one `Outcome` per run and
    question (see the module's docstring): outcome `i * prompt.n_questions + q` is run i's answer to
    question q, so with one question outcome i is run i's. A failing prefill raises (every run of the
    prompt fails with it); a failing run keeps its error in its outcomes and the others go on.
    `on_outcome(k, outcome)` is called as soon as outcome k is final (e.g. to print each answer when
    it is ready); `prefill_store` keeps the natives' prefills (`centroidkv.plan.prefill_store`).
    ValueError for follow-up questions under the full-prompt protocol."""
    check_decode_batch(decode_batch)
    if prompt.follow_ups and prompt.protocol != CONTEXT_ONLY:
        raise ValueError("several questions need the context-only protocol (one compressed context)")
    if not prompt.context and any(compresses_in_prefill(r.method) for r in runs):
        raise ValueError(
            "a method that compresses inside its prefill needs the prompt's context (Prompt.context)"
        )
    eos = default_eos(model) if eos_token_ids is None else eos_token_ids
    shared = _Shared(model, prompt, max_new_tokens, eos, budget_unit, prefill_store)
    in_prefill = {
        i: r.method.prefill_run(model, r.budget, len(prompt.context), max_new_tokens, share_prefill)
        for i, r in enumerate(runs)
        if compresses_in_prefill(r.method)
    }
    natives = [i for i in range(len(runs)) if i not in in_prefill]
    taps = {i: r for i, r in in_prefill.items() if r.shares_prefill}
    native_prefill, tapped_prefill = _prefills(shared, [runs[i].method for i in natives], taps)
    plan = _Plan(shared, runs, context_only=set(in_prefill))
    for i in natives:
        plan.add_native(i, native_prefill)
    finished = chain(  # each step yields the outcomes it made final, as soon as they are
        plan.add_taps(taps, tapped_prefill),
        plan.start_all(),
        plan.run_own_prefills({i: r for i, r in in_prefill.items() if i not in taps}),
        plan.decode_all(decode_batch),
    )
    for k in finished:
        outcome = plan.outcomes[k]
        if outcome.generation is not None:
            outcome.answer_ids = answer_ids(outcome.generation.tokens[0], eos)
        if on_outcome is not None:
            on_outcome(k, outcome)
    return plan.outcomes


def answer_ids(generated: list[int], eos_token_ids: set[int]) -> list[int]:
    """The generated ids without a final end-of-sequence token: the answer's text."""
    return generated[:-1] if generated and generated[-1] in eos_token_ids else list(generated)


@dataclass(frozen=True)
class _Shared:
    """What every run of one `run` call shares."""

    model: nn.Module
    prompt: Prompt
    max_new_tokens: int
    eos: set[int]
    budget_unit: str | None
    prefill_store: PrefillStore | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def ids(self, tokens: list[int]) -> torch.Tensor | None:
        """`tokens` as a batch of one on the model's device; None for no token."""
        return torch.tensor([tokens], device=self.device) if tokens else None


def _prefills(
    shared: _Shared, native_methods: list[Method], taps: dict[int, PrefillRun]
) -> tuple[Prefill | None, Prefill | None]:
    """The natives' shared prefill (read from the prefill store when there) and the taps': one forward
    for both when they prefill the same tokens and nothing the natives record changes the attention."""
    model, prompt, max_new_tokens = shared.model, shared.prompt, shared.max_new_tokens
    native_needs = needs_of(native_methods)
    one_pass = bool(
        native_methods
        and taps
        and prompt.prefilled == prompt.context
        and not any(RECORDERS[need.name].uses_received for need in native_needs)
    )
    native_prefill = tapped_prefill = None
    if native_methods:
        ids, tapping = shared.ids(prompt.prefilled), taps if one_pass else None
        native_prefill = stored_prefill(
            shared.prefill_store, model, ids, max_new_tokens, native_needs, tapping
        )
    if taps:  # a stored prefill holds no tap's fork: the taps then get a forward of their own
        reused = one_pass and not native_prefill.stored
        context = shared.ids(prompt.context)
        tapped_prefill = native_prefill if reused else prefill(model, context, max_new_tokens, taps=taps)
    return native_prefill, tapped_prefill


@dataclass(frozen=True)
class _ForkStart:
    """How one outcome's fork starts, as often as needed (a failed batch starts each of its forks
    again: the source is never modified): a fork of `source` compressed with (method, budget), then
    `fed` fed. `compress_s`: a tap's compression, recorded as the fork's own. `hooks`: the run's
    decoding hooks when they change the model; the fork then starts and decodes alone under them."""

    source: Prefill | _CompressedOnce
    method: Method | str
    budget: float
    fed: list[int]
    compress_s: float | None = None
    hooks: Callable[[nn.Module], AbstractContextManager] | None = None

    def hooks_on(self, model: nn.Module) -> AbstractContextManager:
        return self.hooks(model) if self.hooks is not None else nullcontext()

    def fork(self, shared: _Shared) -> Fork:
        source, compress_s, measured = self.source, self.compress_s, {}
        if isinstance(source, _CompressedOnce):  # compressed already, for several questions
            source, compress_s, measured = source.get()
        fork = start_fork(
            shared.model,
            source,
            self.method,
            self.budget,
            shared.max_new_tokens,
            shared.ids(self.fed),
            shared.budget_unit,
            compress_s=compress_s,
        )
        fork.measured.update(measured)  # a fork holds no decode headroom of its own before its first write
        return fork


class _CompressedOnce:
    """A native run's context compressed once (on first use), for several questions. Each question
    forks the compressed cache with the same method and budget, which keeps every entry and record
    as they are (nothing is over the budget), and takes what the compression kept (`COMPRESSED`
    measurements, this compression's time) from the compressed cache itself."""

    def __init__(self, source: Prefill, run: Run, shared: _Shared):
        self.source, self.run, self.shared = source, run, shared
        self.compressed: tuple[Prefill, float, dict[str, Any]] | None = None

    def get(self) -> tuple[Prefill, float, dict[str, Any]]:
        """The compressed context, the compression's seconds and its `COMPRESSED` measurements."""
        if self.compressed is None:
            source, method, budget = self.source, self.run.method, self.run.budget
            unit = self.shared.budget_unit
            with Timer(source.first_token.device).span() as compressing:
                cache = source.cache.fork(method, budget, self.shared.max_new_tokens, budget_unit=unit)
            state = RunState(cache, prefill_s=source.seconds, compress_s=compressing.seconds)
            compressed = Prefill(cache, source.first_token, source.seconds)
            self.compressed = (compressed, compressing.seconds, measure(COMPRESSED, state))
        return self.compressed


class _Plan:
    """The outcomes of one `run` call (run i's answer to question q is outcome `i * n_questions + q`),
    how each outcome's fork starts (`starts`) and the forks started and not decoded yet (`forks`).
    Each step that can make an outcome final is a generator of the outcomes it made final."""

    def __init__(self, shared: _Shared, runs: Sequence[Run], context_only: set[int]):
        self.shared, self.runs = shared, runs
        self.outcomes = [
            Outcome(CONTEXT_ONLY if i in context_only else shared.prompt.protocol, question=q)
            for i in range(len(runs))
            for q in range(shared.prompt.n_questions)
        ]
        self.starts: dict[int, _ForkStart] = {}
        self.forks: dict[int, Fork] = {}

    def keys(self, i: int) -> range:
        """Run i's outcomes, one per question."""
        n_questions = self.shared.prompt.n_questions
        return range(i * n_questions, (i + 1) * n_questions)

    def add_native(self, i: int, native_prefill: Prefill) -> None:
        """A native run forks the shared prefill. One question: the fork is compressed and fed in one
        go. Several: the context is compressed once, and each question forks that compressed cache."""
        run, prompt = self.runs[i], self.shared.prompt
        once = prompt.n_questions == 1
        source = native_prefill if once else _CompressedOnce(native_prefill, run, self.shared)
        stored = {"prefill_stored": True} if native_prefill.stored else {}  # only where it is
        for k in self.keys(i):
            outcome = self.outcomes[k]
            outcome.fields = {"prefill_shared": True, **stored}
            self.starts[k] = _ForkStart(source, run.method, run.budget, prompt.fed_ids(outcome.question))

    def add_taps(self, taps: dict[int, PrefillRun], tapped_prefill: Prefill | None) -> Iterator[int]:
        """A tap decodes its fork of the prefill it compressed, uncompressed further ("full"); the
        outcomes of a tap that failed are final."""
        for i, tap in taps.items():
            tapped = tapped_prefill.tapped[i]
            source = Prefill(tapped.cache, tapped_prefill.first_token, tapped_prefill.seconds)
            for k in self.keys(i):
                outcome = self.outcomes[k]
                outcome.fields = {"prefill_shared": True, **tap.record_fields()}
                if tapped.error is not None:
                    outcome.error = tapped.error
                    yield k
                    continue
                # its masks live on the attention modules: fed and decoded under them, alone
                hooks = tap.decoding_hooks if tap.decodes_alone else None
                question = self.shared.prompt.question_ids(outcome.question)
                self.starts[k] = _ForkStart(source, "full", 1.0, question, tapped.seconds, hooks)

    def start_all(self) -> Iterator[int]:
        """Start every fork (compress it, feed its question); the outcome of one that fails is final."""
        for k in self.starts:
            if not self.start(k):
                yield k

    def start(self, k: int) -> bool:
        """Start outcome k's fork, or keep its error in the outcome; whether it started."""
        start = self.starts[k]
        try:
            with start.hooks_on(self.shared.model):
                self.forks[k] = start.fork(self.shared)
            return True
        except Exception as error:
            _free_memory(self.shared.device)
            self.outcomes[k].error = error
            return False

    def run_own_prefills(self, own: dict[int, PrefillRun]) -> Iterator[int]:
        """Each prefill compressor with a prefill of its own: prefill the context under its hooks (the
        compression is part of that forward, so of prefill_s), then for each question feed it and
        decode under its decoding hooks, from the cache it compressed (each question a fork of it, no
        further compression)."""
        shared = self.shared
        for i, prefill_run in own.items():
            for k in self.keys(i):
                self.outcomes[k].fields = {"prefill_shared": False}
            try:
                with prefill_run.prefill_hooks(shared.model):
                    source = prefill(shared.model, shared.ids(shared.prompt.context), shared.max_new_tokens)
            except Exception as error:
                _free_memory(shared.device)
                for k in self.keys(i):
                    self.outcomes[k].error = error
                yield from self.keys(i)
                continue
            for k in self.keys(i):
                self.answer_from_own_prefill(prefill_run, source, self.outcomes[k])
                yield k

    def answer_from_own_prefill(self, prefill_run: PrefillRun, source: Prefill, outcome: Outcome) -> None:
        """`outcome`'s question fed to a fork of `source` (the cache the run compressed in its own
        prefill) and decoded alone, under the run's decoding hooks."""
        model, max_new_tokens = self.shared.model, self.shared.max_new_tokens
        try:
            with prefill_run.decoding_hooks(model):
                question = self.shared.ids(self.shared.prompt.question_ids(outcome.question))
                fork = start_fork(model, source, "full", 1.0, max_new_tokens, question)
                outcome.generation = decode_forks(model, [fork], max_new_tokens, self.shared.eos)[0]
            outcome.fields.update({**prefill_run.record_fields(), "decode_batch": 1})
        except Exception as error:
            _free_memory(self.shared.device)
            outcome.error = error

    def decode_all(self, decode_batch: int) -> Iterator[int]:
        """Up to `decode_batch` forks per batch, in the order they started, a hooked one alone; a
        failed batch retries each of its forks alone from its own source, so one fork's failure
        stays its own."""
        batchable = [k for k in self.forks if self.starts[k].hooks is None]
        batches = [batchable[b : b + decode_batch] for b in range(0, len(batchable), decode_batch)]
        batches += [[k] for k in self.forks if self.starts[k].hooks is not None]
        for batch in batches:
            failed = self.decode(batch)
            if failed is not None and len(batch) > 1:
                yield from self.retry_alone(batch)
                continue
            if failed is not None:
                self.outcomes[batch[0]].error = failed
                del self.forks[batch[0]]
            yield from batch

    def retry_alone(self, batch: list[int]) -> Iterator[int]:
        """Each fork of a failed batch again, alone, from its own (unchanged) source."""
        for k in batch:
            del self.forks[k]
            if self.start(k):
                failed = self.decode([k])
                if failed is not None:
                    self.outcomes[k].error = failed
                    del self.forks[k]
            yield k

    def decode(self, batch: list[int]) -> BaseException | None:
        """Decode the forks of `batch` as one batch into their outcomes; the error if it failed."""
        model = self.shared.model
        try:
            with self.starts[batch[0]].hooks_on(model):  # a hooked run is a batch of its own
                forks = [self.forks[k] for k in batch]
                generations = decode_forks(model, forks, self.shared.max_new_tokens, self.shared.eos)
        except Exception as error:
            _free_memory(self.shared.device)
            return error
        for k, generation in zip(batch, generations, strict=True):
            self.outcomes[k].generation = generation
            self.outcomes[k].fields["decode_batch"] = len(batch)
            del self.forks[k]  # its cache can go
        return None


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(
    model: nn.Module,
    methods: Iterable[Method | str] = ("centroidkv",),
    budget: float = 0.5,
    budget_unit: str | None = None,
    prompt_len: int = 256,
) -> float:
    """Pay a process's one-time costs before timing (a first compression is several times slower than
    the next): a tiny prefill, then per method (default CentroidKV) a fork compressed at the caller's
    `budget` and a few decode steps, through `run`. Never fails: a method that cannot run on this short
    prompt is not warmed (its real run reports its own error). Returns the seconds it took."""
    start = time.perf_counter()
    runs = [Run.at(get_method(m) if isinstance(m, str) else m, budget) for m in methods]
    ids = (torch.arange(prompt_len) % (model.config.vocab_size - 10) + 10).tolist()
    try:  # a run's error stays in its outcome (dropped); a failing prefill fails the real run too
        run(model, Prompt(ids, [], ids, []), runs, 4, set(), budget_unit, decode_batch=1)
    except Exception:
        _free_memory(next(model.parameters()).device)
    return time.perf_counter() - start
