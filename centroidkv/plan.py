"""One plan per prompt: every (method, budget) run of one prompt, from as few prefills as possible.

`run(model, prompt, runs, ...)` is the one place that decides, for one prompt:

1. which prefill each run starts from. A native method forks one shared prefill of the prompt that
   recorded what every native run needs (`centroidkv.needs`). A method that compresses inside a
   prefill forward instead (`PrefillCompressor`: a bridge to another library's prefill hooks) hands
   back a per-run object (`PrefillRun`); with `share_prefill`, that object compresses its own fork
   of a prefill of the context layer by layer (`centroidkv.decoding.PrefillTap`), else it gets a
   prefill of its own with its hooks active. One forward serves natives and taps when both prefill
   the same tokens and nothing the natives record changes the attention's arithmetic;
2. how the forks decode: up to `decode_batch` of them as the rows of one batch (one weight pass per
   step), a run whose decoding hooks change the model (masks on the attention modules) alone;
3. what a failure costs: a batch that fails starts each of its forks again from its own source and
   decodes it alone, so one fork's failure stays its own; a run that fails keeps its error.

It returns one `Outcome` per run, in order. A prefill compressor always runs the context-only
protocol (context prefilled and compressed, question fed afterwards); the natives run the prompt as
given (`Prompt.protocol`). A context-only prompt may carry further questions (`Prompt.follow_ups`):
each run compresses the context once and answers every question from a fork of that compressed
cache, as kvpress's pipeline does with `questions=[...]` (one outcome per run and question).
`centroidkv.generate`, `warm_up` and the harness's per-sample evaluation all call `run`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from centroidkv.cache import CompressedCache
from centroidkv.decoding import (
    Fork,
    Generation,
    Prefill,
    decode_forks,
    default_eos,
    needs_of,
    prefill,
    start_fork,
)
from centroidkv.measurements import COMPRESSED, RunState, measure
from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS
from centroidkv.run_options import (  # noqa: F401
    CONTEXT_ONLY,
    DEFAULT_DECODE_BATCH,
    FULL_PROMPT,
    PROTOCOLS,
    check_decode_batch,
)
from centroidkv.timing import Timer


class PrefillRun(Protocol):
    """One run of a `PrefillCompressor` on one prompt; it holds every piece of per-run state.

    `shares_prefill`: it compresses its fork of a shared prefill as a `PrefillTap` (`after_layer`);
    otherwise `prefill_hooks` are active during a prefill of its own, whose cache they compress.
    `decoding_hooks` are active while its question is fed and it decodes; `decodes_alone` says they
    change the model (so the run is never batched with others). `record_fields` are added to its
    record (e.g. whether it saved memory or only masked)."""

    shares_prefill: bool

    def after_layer(self, module: nn.Module, kwargs: dict, output: Any, cache: CompressedCache) -> None: ...

    def prefill_hooks(self, model: nn.Module) -> AbstractContextManager: ...

    def decoding_hooks(self, model: nn.Module) -> AbstractContextManager: ...

    @property
    def decodes_alone(self) -> bool: ...

    def record_fields(self) -> dict[str, Any]: ...


@runtime_checkable
class PrefillCompressor(Protocol):
    """A method that compresses inside a prefill forward rather than forking the shared prefill.
    `budget` means what it means for every method: R * (context_len + max_new_tokens) entries."""

    def prefill_run(
        self, model: nn.Module, budget: float, context_len: int, max_new_tokens: int, share_prefill: bool
    ) -> PrefillRun: ...


def compresses_in_prefill(method: Method) -> bool:
    return isinstance(method, PrefillCompressor)


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
    """One method at one budget (R), in `budget_unit` (None: the default unit, `centroidkv.budget`)."""

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
) -> list[Outcome]:
    """Every run of `runs` on `prompt`, greedy, `max_new_tokens` at most, one `Outcome` per run and
    question (see the module's docstring): outcome `i * prompt.n_questions + q` is run i's answer to
    question q, so with one question outcome i is run i's. A failing prefill raises (every run of the
    prompt fails with it); a failing run keeps its error in its outcomes and the others go on.
    `on_outcome(k, outcome)` is called as soon as outcome k is final (e.g. to print each answer when
    it is ready). ValueError for follow-up questions under the full-prompt protocol."""
    check_decode_batch(decode_batch)
    if prompt.follow_ups and prompt.protocol != CONTEXT_ONLY:
        raise ValueError("several questions need the context-only protocol (one compressed context)")
    eos = default_eos(model) if eos_token_ids is None else eos_token_ids
    if not prompt.context and any(compresses_in_prefill(r.method) for r in runs):
        raise ValueError(
            "a method that compresses inside its prefill needs the prompt's context (Prompt.context)"
        )
    in_prefill = {
        i: r.method.prefill_run(model, r.budget, len(prompt.context), max_new_tokens, share_prefill)
        for i, r in enumerate(runs)
        if compresses_in_prefill(r.method)
    }
    plan = _Plan(model, prompt, runs, max_new_tokens, eos, budget_unit, on_outcome, set(in_prefill))
    natives = [i for i in range(len(runs)) if i not in in_prefill]
    taps = {i: r for i, r in in_prefill.items() if r.shares_prefill}
    native_prefill, press_prefill = _prefills(plan, natives, taps)
    for i in natives:
        plan.add_native(i, native_prefill)
    for i, tap in taps.items():
        plan.add_tap(i, tap, press_prefill)
    plan.start_all()
    for i, prefill_run in in_prefill.items():
        if i not in taps:
            plan.run_own(i, prefill_run)
    plan.decode_all(decode_batch)
    return plan.outcomes


def _prefills(
    plan: _Plan, natives: list[int], taps: dict[int, PrefillRun]
) -> tuple[Prefill | None, Prefill | None]:
    """The shared prefill of the native runs and the one the taps compress in: one forward for both
    when they prefill the same tokens and nothing the natives record changes the attention."""
    model, prompt, max_new_tokens = plan.model, plan.prompt, plan.max_new_tokens
    native_needs = needs_of(plan.runs[i].method for i in natives)
    one_pass = bool(
        natives
        and taps
        and prompt.prefilled == prompt.context
        and not any(RECORDERS[need.name].uses_received for need in native_needs)
    )
    native_prefill = press_prefill = None
    if natives:
        native_prefill = prefill(
            model,
            plan.ids(prompt.prefilled),
            max_new_tokens,
            needs=native_needs,
            taps=taps if one_pass else None,
        )
    if taps:
        press_prefill = (
            native_prefill
            if one_pass
            else prefill(model, plan.ids(prompt.context), max_new_tokens, taps=taps)
        )
    return native_prefill, press_prefill


class _Plan:
    """One call of `run`: its outcomes (run i's answer to question q is `i * n_questions + q`), how to
    start each outcome's fork again (`starters`: its source is never modified, so a failed batch can
    retry each fork alone), the decoding hooks of the runs that decode alone, and the started forks."""

    def __init__(self, model, prompt, runs, max_new_tokens, eos, budget_unit, on_outcome, context_only_runs):
        self.model, self.prompt, self.runs, self.max_new_tokens = model, prompt, runs, max_new_tokens
        self.eos, self.budget_unit, self.on_outcome = eos, budget_unit, on_outcome
        self.device = next(model.parameters()).device
        self.outcomes = [
            Outcome(CONTEXT_ONLY if i in context_only_runs else prompt.protocol, question=q)
            for i in range(len(runs))
            for q in range(prompt.n_questions)
        ]
        self.starters: dict[int, Callable[[], Fork]] = {}
        self.hooks: dict[int, Callable[[nn.Module], AbstractContextManager]] = {}
        self.forks: dict[int, Fork] = {}

    def ids(self, tokens: list[int]) -> torch.Tensor | None:
        return torch.tensor([tokens], device=self.device) if tokens else None

    def keys(self, i: int) -> range:
        """Run i's outcomes, one per question."""
        return range(i * self.prompt.n_questions, (i + 1) * self.prompt.n_questions)

    def finish(self, k: int) -> None:
        outcome = self.outcomes[k]
        if outcome.generation is not None:
            outcome.answer_ids = answer_ids(outcome.generation.tokens[0], self.eos)
        if self.on_outcome is not None:
            self.on_outcome(k, outcome)

    def add_native(self, i: int, native_prefill: Prefill) -> None:
        """A native run forks the shared prefill. One question: the fork is compressed and fed in one
        go. Several: the context is compressed once, and each question forks that compressed cache."""
        method, budget = self.runs[i].method, self.runs[i].budget
        source = (
            native_prefill
            if self.prompt.n_questions == 1
            else _CompressedOnce(native_prefill, self.runs[i], self.max_new_tokens, self.budget_unit)
        )
        for k in self.keys(i):
            self.outcomes[k].fields = {"prefill_shared": True}
            fed = self.ids(self.prompt.fed_ids(self.outcomes[k].question))
            self.starters[k] = partial(
                _start_native, self.model, source, method, budget, self.max_new_tokens, fed, self.budget_unit
            )

    def add_tap(self, i: int, tap: PrefillRun, press_prefill: Prefill) -> None:
        """A tap decodes its fork of the prefill it compressed, uncompressed further ("full")."""
        tapped = press_prefill.tapped[i]
        source = Prefill(tapped.cache, press_prefill.first_token, press_prefill.seconds)
        for k in self.keys(i):
            self.outcomes[k].fields = {"prefill_shared": True, **tap.record_fields()}
            if tapped.error is not None:
                self.outcomes[k].error = tapped.error
                self.finish(k)
                continue
            if tap.decodes_alone:  # its masks live on the attention modules: fed and decoded under them
                self.hooks[k] = tap.decoding_hooks
            question = self.ids(self.prompt.question_ids(self.outcomes[k].question))
            fork_args = (self.model, source, "full", 1.0, self.max_new_tokens, question, self.budget_unit)
            self.starters[k] = partial(start_fork, *fork_args, compress_s=tapped.seconds)

    def start_all(self) -> None:
        for k in self.starters:
            fork = _start(k, self.starters, self.hooks, self.model, self.outcomes)
            if fork is None:
                self.finish(k)
            else:
                self.forks[k] = fork

    def run_own(self, i: int, prefill_run: PrefillRun) -> None:
        outcomes = [self.outcomes[k] for k in self.keys(i)]
        _run_own_prefill(
            self.model, prefill_run, self.prompt, self.max_new_tokens, self.eos, outcomes, self.ids
        )
        for k in self.keys(i):
            self.finish(k)

    def decode_all(self, decode_batch: int) -> None:
        """Up to `decode_batch` forks per batch, a hooked one alone; a failed batch retries each of
        its forks alone from its own source, so one fork's failure stays its own."""
        batchable = [k for k in self.forks if k not in self.hooks]
        batches = [batchable[b : b + decode_batch] for b in range(0, len(batchable), decode_batch)]
        batches += [[k] for k in self.forks if k in self.hooks]
        for batch in batches:
            try:
                self.decode(batch)
            except Exception as error:
                _free_memory(self.device)
                if len(batch) == 1:
                    self.fail(batch[0], error)
                else:
                    for k in batch:
                        self.retry_alone(k)
                continue
            for k in batch:
                self.finish(k)

    def decode(self, batch: list[int]) -> None:
        _decode(batch, self.forks, self.hooks, self.model, self.max_new_tokens, self.eos, self.outcomes)

    def fail(self, k: int, error: BaseException) -> None:
        self.outcomes[k].error = error
        self.forks.pop(k, None)
        self.finish(k)

    def retry_alone(self, k: int) -> None:
        """Outcome k again, alone, from its own (unchanged) source."""
        self.forks.pop(k, None)
        fork = _start(k, self.starters, self.hooks, self.model, self.outcomes)
        if fork is not None:
            self.forks[k] = fork
            try:
                self.decode([k])
            except Exception as error_alone:
                _free_memory(self.device)
                self.outcomes[k].error = error_alone
                self.forks.pop(k, None)
        self.finish(k)


class _CompressedOnce:
    """A native run's context compressed once (on first use), for several questions. Each question
    forks the compressed cache with the same method and budget, which keeps every entry and record
    as they are (nothing is over the budget), and takes what the compression kept (`COMPRESSED`
    measurements, this compression's time) from the compressed cache itself."""

    def __init__(self, source: Prefill, run: Run, max_new_tokens: int, budget_unit: str | None):
        self.source, self.run, self.max_new_tokens, self.budget_unit = (
            source,
            run,
            max_new_tokens,
            budget_unit,
        )
        self.compressed: tuple[Prefill, float, dict[str, Any]] | None = None

    def get(self) -> tuple[Prefill, float, dict[str, Any]]:
        if self.compressed is None:
            timer = Timer(self.source.first_token.device)
            with timer.span() as compressing:
                cache = self.source.cache.fork(
                    self.run.method, self.run.budget, self.max_new_tokens, budget_unit=self.budget_unit
                )
            state = RunState(cache, prefill_s=self.source.seconds, compress_s=compressing.seconds)
            compressed = Prefill(cache, self.source.first_token, self.source.seconds)
            self.compressed = (compressed, compressing.seconds, measure(COMPRESSED, state))
        return self.compressed


def _start_native(
    model: nn.Module,
    source: Prefill | _CompressedOnce,
    method: Method,
    budget: float,
    max_new_tokens: int,
    fed: torch.Tensor | None,
    budget_unit: str | None,
) -> Fork:
    """A native run's fork for one question: from the shared prefill (compressed now) or from the
    context compressed once for several questions."""
    if not isinstance(source, _CompressedOnce):
        return start_fork(model, source, method, budget, max_new_tokens, fed, budget_unit)
    compressed, compress_s, measured = source.get()
    fork = start_fork(
        model, compressed, method, budget, max_new_tokens, fed, budget_unit, compress_s=compress_s
    )
    fork.measured.update(measured)  # a fork holds no decode headroom of its own before its first write
    return fork


def answer_ids(generated: list[int], eos_token_ids: set[int]) -> list[int]:
    """The generated ids without a final end-of-sequence token: the answer's text."""
    return generated[:-1] if generated and generated[-1] in eos_token_ids else list(generated)


def _hooks_of(i: int, hooks: dict, model: nn.Module) -> AbstractContextManager:
    return hooks[i](model) if i in hooks else nullcontext()


def _start(i: int, starters: dict, hooks: dict, model: nn.Module, outcomes: list[Outcome]) -> Fork | None:
    """Start run `i` (compress its fork, feed its question), or keep its error."""
    try:
        with _hooks_of(i, hooks, model):
            return starters[i]()
    except Exception as error:
        _free_memory(next(model.parameters()).device)
        outcomes[i].error = error
        return None


def _decode(
    batch: list[int],
    forks: dict[int, Fork],
    hooks: dict,
    model: nn.Module,
    max_new_tokens: int,
    eos: set[int],
    outcomes: list[Outcome],
) -> None:
    with _hooks_of(batch[0], hooks, model):  # a hooked run is a batch of its own
        generations = decode_forks(model, [forks[i] for i in batch], max_new_tokens, eos)
    for i, generation in zip(batch, generations, strict=True):
        outcomes[i].generation = generation
        outcomes[i].fields["decode_batch"] = len(batch)
        del forks[i]  # its cache can go


def _run_own_prefill(
    model: nn.Module,
    prefill_run: PrefillRun,
    prompt: Prompt,
    max_new_tokens: int,
    eos: set[int],
    outcomes: list[Outcome],
    ids: Callable[[list[int]], torch.Tensor | None],
) -> None:
    """A prefill compressor with a prefill of its own: prefill the context under its hooks (the
    compression is part of that forward, so of prefill_s), then for each question (`outcomes`, one
    per question) feed it and decode under its decoding hooks, from the cache it compressed (each
    question a fork of it, no further compression)."""
    for outcome in outcomes:
        outcome.fields = {"prefill_shared": False}
    try:
        with prefill_run.prefill_hooks(model):
            source = prefill(model, ids(prompt.context), max_new_tokens)
    except Exception as error:
        _free_memory(next(model.parameters()).device)
        for outcome in outcomes:
            outcome.error = error
        return
    for outcome in outcomes:
        try:
            with prefill_run.decoding_hooks(model):
                question = ids(prompt.question_ids(outcome.question))
                fork = start_fork(model, source, "full", 1.0, max_new_tokens, question)
                outcome.generation = decode_forks(model, [fork], max_new_tokens, eos)[0]
            outcome.fields.update({**prefill_run.record_fields(), "decode_batch": 1})
        except Exception as error:
            _free_memory(next(model.parameters()).device)
            outcome.error = error


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
