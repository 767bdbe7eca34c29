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
given (`Prompt.protocol`). `centroidkv.generate`, `warm_up` and the harness's per-sample evaluation
all call `run`.
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
from centroidkv.methods import Method
from centroidkv.needs import RECORDERS
from centroidkv.run_options import (  # noqa: F401
    CONTEXT_ONLY,
    DEFAULT_DECODE_BATCH,
    FULL_PROMPT,
    PROTOCOLS,
    check_decode_batch,
)


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
    (`context`, `question`), which prefill compressors always use."""

    prefilled: list[int]
    fed: list[int]
    context: list[int]
    question: list[int]
    protocol: str = FULL_PROMPT  # the protocol of (prefilled, fed)


@dataclass(frozen=True)
class Run:
    """One method at one budget (R), in `budget_unit` (None: the default unit, `centroidkv.budget`)."""

    method: Method
    budget: float


@dataclass
class Outcome:
    """A run's result: its generation or its error, the protocol it ran, and its record fields
    (`prefill_shared`, `decode_batch`, a prefill compressor's own). `answer_ids`: the first row's
    generated ids without a final end-of-sequence token (the text a benchmark scores)."""

    protocol: str
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
    """Every run of `runs` on `prompt`, greedy, `max_new_tokens` at most, one `Outcome` each (see the
    module's docstring). A failing prefill raises (every run of the prompt fails with it); a failing
    run keeps its error in its outcome and the others go on. `on_outcome(i, outcome)` is called as
    soon as run i's outcome is final (e.g. to print each answer when it is ready)."""
    check_decode_batch(decode_batch)
    eos = default_eos(model) if eos_token_ids is None else eos_token_ids
    device = next(model.parameters()).device

    def finish(i: int) -> None:
        outcome = outcomes[i]
        if outcome.generation is not None:
            outcome.answer_ids = answer_ids(outcome.generation.tokens[0], eos)
        if on_outcome is not None:
            on_outcome(i, outcome)

    def ids(tokens: list[int]) -> torch.Tensor | None:
        return torch.tensor([tokens], device=device) if tokens else None

    in_prefill = {
        i: r.method.prefill_run(model, r.budget, len(prompt.context), max_new_tokens, share_prefill)
        for i, r in enumerate(runs)
        if compresses_in_prefill(r.method)
    }
    outcomes = [Outcome(CONTEXT_ONLY if i in in_prefill else prompt.protocol) for i in range(len(runs))]
    natives = [i for i in range(len(runs)) if i not in in_prefill]
    taps = {i: r for i, r in in_prefill.items() if r.shares_prefill}
    own = [i for i in in_prefill if i not in taps]

    native_needs = needs_of(runs[i].method for i in natives)
    one_pass = bool(
        natives
        and taps
        and prompt.prefilled == prompt.context
        and not any(RECORDERS[need.name].uses_received for need in native_needs)
    )
    native_prefill = press_prefill = None
    if natives:
        native_prefill = prefill(
            model, ids(prompt.prefilled), max_new_tokens, needs=native_needs, taps=taps if one_pass else None
        )
    if taps:
        press_prefill = (
            native_prefill if one_pass else prefill(model, ids(prompt.context), max_new_tokens, taps=taps)
        )

    # Each started run keeps how to start it again (its source is never modified), for the retry.
    starters: dict[int, Callable[[], Fork]] = {}
    hooks: dict[int, Callable[[nn.Module], AbstractContextManager]] = {}
    for i in natives:
        outcomes[i].fields = {"prefill_shared": True}
        method, budget = runs[i].method, runs[i].budget
        starters[i] = partial(
            start_fork, model, native_prefill, method, budget, max_new_tokens, ids(prompt.fed), budget_unit
        )
    for i, tap in taps.items():
        outcomes[i].fields = {"prefill_shared": True, **tap.record_fields()}
        tapped = press_prefill.tapped[i]
        if tapped.error is not None:
            outcomes[i].error = tapped.error
            finish(i)
            continue
        if tap.decodes_alone:  # its masks live on the attention modules: fed and decoded under them
            hooks[i] = tap.decoding_hooks
        source = Prefill(tapped.cache, press_prefill.first_token, press_prefill.seconds)
        starters[i] = partial(
            start_fork,
            model,
            source,
            "full",
            1.0,
            max_new_tokens,
            ids(prompt.question),
            budget_unit,
            compress_s=tapped.seconds,
        )
    forks: dict[int, Fork] = {}
    for i in starters:
        fork = _start(i, starters, hooks, model, outcomes)
        if fork is None:
            finish(i)
        else:
            forks[i] = fork
    for i in own:
        _run_own_prefill(model, in_prefill[i], prompt, max_new_tokens, eos, outcomes[i], ids)
        finish(i)

    batchable = [i for i in forks if i not in hooks]
    batches = [batchable[k : k + decode_batch] for k in range(0, len(batchable), decode_batch)]
    batches += [[i] for i in forks if i in hooks]
    for batch in batches:
        try:
            _decode(batch, forks, hooks, model, max_new_tokens, eos, outcomes)
        except Exception as error:
            _free_memory(device)
            if len(batch) == 1:
                outcomes[batch[0]].error = error
                forks.pop(batch[0], None)
                finish(batch[0])
                continue
            for i in batch:  # again, one at a time, each from its own (unchanged) source
                forks.pop(i, None)
                fork = _start(i, starters, hooks, model, outcomes)
                if fork is not None:
                    forks[i] = fork
                    try:
                        _decode([i], forks, hooks, model, max_new_tokens, eos, outcomes)
                    except Exception as error_alone:
                        _free_memory(device)
                        outcomes[i].error = error_alone
                        forks.pop(i, None)
                finish(i)
            continue
        for i in batch:
            finish(i)
    return outcomes


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
    outcome: Outcome,
    ids: Callable[[list[int]], torch.Tensor | None],
) -> None:
    """A prefill compressor with a prefill of its own: prefill the context under its hooks (the
    compression is part of that forward, so of prefill_s), then feed the question and decode under
    its decoding hooks, on the cache it compressed (no fork, no further compression)."""
    outcome.fields = {"prefill_shared": False}
    try:
        with prefill_run.prefill_hooks(model):
            source = prefill(model, ids(prompt.context), max_new_tokens)
        with prefill_run.decoding_hooks(model):
            fork = start_fork(model, source, "full", 1.0, max_new_tokens, ids(prompt.question))
            outcome.generation = decode_forks(model, [fork], max_new_tokens, eos)[0]
        outcome.fields.update({**prefill_run.record_fields(), "decode_batch": 1})
    except Exception as error:
        _free_memory(next(model.parameters()).device)
        outcome.error = error


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(
    model: nn.Module, methods: Iterable[Method | str] = ("centroidkv",), prompt_len: int = 256
) -> float:
    """Pay a process's one-time costs before timing anything: one tiny prefill, then a compressed
    fork + a few decode steps per method (default: CentroidKV, whose first compression in a process
    is several times slower than the next ones), through the per-prompt plan (`run`).
    Returns the seconds it took. The runner does the same per job (`warmup: true`)."""
    from centroidkv.methods import get_method  # the registry, at call time (methods may be added late)

    start = time.perf_counter()
    built = [get_method(m) if isinstance(m, str) else m for m in methods]
    device = next(model.parameters()).device
    ids = (torch.arange(prompt_len, device=device) % (model.config.vocab_size - 10) + 10).tolist()
    prompt = Prompt(ids, [], ids, [])
    for outcome in run(model, prompt, [Run(m, 0.5) for m in built], 4, eos_token_ids=set(), decode_batch=1):
        if outcome.error is not None:
            raise outcome.error
    return time.perf_counter() - start
