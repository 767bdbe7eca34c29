"""Prefill once, then greedy-decode with any number of compressed forks of that prefill, timed.

`prefill` runs the prompt with a full cache (recording what query-aware methods need);
`start_fork` forks it with a (method, budget), compresses and optionally feeds more tokens with
compression paused (the question, in the context-only protocol); `decode_forks` decodes forks
greedily, alone or as the rows of one batch; `generate_from` is the two for one fork; a prompt's
token ids come from `centroidkv.models.chat`. Which runs share which prefill, and how forks are batched, is
decided once per prompt by `centroidkv.plan.plan.run`.
What each run measures is declared in `centroidkv.plan.measurements`.
TTFT = prefill + the fork's compression + the fed tokens; TPOT = mean time of the decode steps
after the first (the first step is a warm-up and is excluded when there are more).
Times come from CUDA events on a GPU and `perf_counter` on a CPU (`centroidkv.plan.timing.Timer`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from centroidkv.attention import attention_modules
from centroidkv.cache.cache import CompressedCache
from centroidkv.cache.fork_batch import ForkBatch
from centroidkv.methods import Method
from centroidkv.needs import Need
from centroidkv.plan.measurements import COMPRESSED, DECODED, FED, RunState, measure
from centroidkv.plan.timing import Timer, peak_memory, reset_peak_memory


@dataclass
class Prefill:
    cache: CompressedCache  # the full, uncompressed cache of the prompt (never modified)
    first_token: Tensor  # [B, 1], argmax after the prompt
    seconds: float  # the forward, without the taps' compressions
    tapped: dict[Hashable, Tapped] = field(default_factory=dict)  # what each tap compressed
    stored: bool = False  # read back from a prefill store (`centroidkv.plan.prefill_store`), not computed


@dataclass
class Generation:
    """One decoded run: the generated ids per batch row (first token included, cut after an
    end-of-sequence token), the entries per layer at the end, and every registered measurement
    (`centroidkv.plan.measurements`) by its record name, also readable as an attribute (`.tpot`)."""

    tokens: list[list[int]]
    seq_lengths: list[int]
    measured: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        measured = self.__dict__.get("measured", {})
        if name in measured:
            return measured[name]
        raise AttributeError(f"{type(self).__name__} has no field or measurement {name!r}")


class PrefillTap(Protocol):
    """A method that compresses inside a prefill, run on a prefill shared with other methods.

    After each attention layer of the shared prefill, `after_layer` gets that layer's call (the
    attention module, its keyword arguments and output) with `cache`, this tap's own fork of the
    prefill's cache, whose layer `module.layer_idx` holds the layer's full keys and values (shared
    tensors: never write into them); it leaves its compressed layer in that fork. The prefill itself
    goes on with the full cache, so every tap sees exactly what it would see in a prefill of its own.
    """

    def after_layer(self, module: nn.Module, kwargs: dict, output: Any, cache: CompressedCache) -> None: ...


@dataclass
class Tapped:
    """What a `PrefillTap` left: its compressed fork, its compression time, or the error it raised."""

    cache: CompressedCache
    seconds: float = 0.0
    error: BaseException | None = None


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: Tensor,
    max_new_tokens: int,
    needs: Iterable[Need] = (),
    taps: Mapping[Hashable, PrefillTap] | None = None,
) -> Prefill:
    """Run the prompt once with a full cache that records `needs` (e.g. `needs_of(methods)`).

    `taps` compress their own forks during this one forward (`PrefillTap`), e.g. one per
    press and budget of a job; `Prefill.tapped` holds the results under the same keys. A tap that
    raises is stopped there (its error kept) and the others go on. `Prefill.seconds` excludes the
    taps' compression time, which each `Tapped.seconds` holds.
    """
    if input_ids.shape[-1] == 0:
        raise ValueError("prefill needs at least one prompt token, got an empty prompt")
    cache = CompressedCache("full", budget=1.0, max_new_tokens=max_new_tokens, needs=needs)
    tapped = {key: Tapped(CompressedCache("full", 1.0, max_new_tokens)) for key in taps or {}}

    def after_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layer = cache.layers[module.layer_idx]
        for key, tap in (taps or {}).items():
            fork = tapped[key]
            if fork.error is not None:
                continue
            fork.cache.take_model_from(cache)
            fork.cache.add_fork_of(layer)
            start = time.perf_counter()
            try:
                tap.after_layer(module, kwargs, output, fork.cache)
            except Exception as error:  # this tap's run fails; the prefill and the other taps go on
                fork.error = error
            fork.seconds += time.perf_counter() - start

    hooks = (
        [m.register_forward_hook(after_attention, with_kwargs=True) for m in attention_modules(model)]
        if taps
        else []
    )
    try:
        with Timer(input_ids.device).span() as span:
            logits = model(input_ids, past_key_values=cache, logits_to_keep=1).logits
            first_token = logits[:, -1].argmax(-1, keepdim=True)
    finally:
        for hook in hooks:
            hook.remove()
    seconds = span.seconds - sum(fork.seconds for fork in tapped.values())
    return Prefill(cache, first_token, seconds, tapped)


def needs_of(methods: Iterable[Method]) -> list[Need]:
    """Everything a prefill must record so that it can be forked to each of `methods`."""
    return [need for method in methods for need in method.needs()]


def default_eos(model: PreTrainedModel) -> set[int]:
    configured = model.generation_config.eos_token_id
    return set(configured if isinstance(configured, list) else [] if configured is None else [configured])


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's, those the model can
    produce (a tiny test model's vocabulary is smaller than the tokenizer's)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    found = [*(eos if isinstance(eos, list) else [eos]), *default_eos(model)]
    return {int(e) for e in found if e is not None and e < model.config.vocab_size}


@dataclass
class Fork:
    """A compressed fork of a prefill with its first token chosen: ready to decode (`decode_forks`).
    `state` holds its times so far; `measured`, what was measured at compression and after the fed
    question (`centroidkv.plan.measurements`)."""

    cache: CompressedCache
    token: Tensor  # [B, 1], the first generated token (after the prompt, or after the fed question)
    state: RunState
    measured: dict[str, Any]


@torch.inference_mode()
def start_fork(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method | str,
    budget: float,
    max_new_tokens: int,
    question_ids: Tensor | None = None,
    budget_unit: str | None = None,
    compress_s: float | None = None,
) -> Fork:
    """Fork `prefilled` with (method, budget), compress, and feed `question_ids` with compression
    paused; the first token follows the prompt (or the question). Raises now when `max_new_tokens`
    will need a compression whose budget cannot hold the protected tokens. `compress_s`: the time of a
    compression already done on `prefilled` (a tap's, `PrefillTap`, then method="full" and budget
    1.0; or the method's own, when one compressed context serves several questions), recorded
    instead of this fork's own."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    timer = Timer(prefilled.first_token.device)
    with timer.span() as compressing:
        cache = prefilled.cache.fork(method, budget, max_new_tokens, budget_unit=budget_unit)
    compressed_s = compressing.seconds if compress_s is None else compress_s
    state = RunState(cache, prefill_s=prefilled.seconds, compress_s=compressed_s)
    measured = measure(COMPRESSED, state)  # before the question: what the compression kept
    token, feed_s = prefilled.first_token, 0.0
    if question_ids is not None and question_ids.shape[1]:
        with timer.span() as feeding, cache.paused():
            logits = model(question_ids, past_key_values=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        feed_s = feeding.seconds
    cache.check_room(max_new_tokens - 1)  # a budget too small for the protected tokens fails before decoding
    state.feed_s = feed_s
    return Fork(cache, token, state, {**measured, **measure(FED, state)})


@torch.inference_mode()
def decode_forks(
    model: PreTrainedModel,
    forks: list[Fork],
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
) -> list[Generation]:
    """Decode `forks` greedily in lockstep, one `Generation` each; a fork stops at its end-of-sequence.

    One fork decodes alone (its batch rows in lockstep) and its steps are timed. Several forks (one
    row each, of one prefill) run as the rows of one batch (`centroidkv.cache.fork_batch`): one weight pass
    per step for all of them, each row attending to its own fork's cache. Their steps are shared,
    so a batched fork reports no TPOT, decode time or memory peak of its own (None).
    """
    eos_token_ids = default_eos(model) if eos_token_ids is None else eos_token_ids
    if not forks:
        return []
    device = forks[0].token.device
    reset_peak_memory(device)  # the peak of decoding (a fork decoded alone reports it), not of the prefill
    generated, step_times = _decode_steps(model, forks, max_new_tokens, eos_token_ids)
    alone = len(forks) == 1
    peak = peak_memory(device) if alone else None
    for fork, steps in zip(forks, step_times, strict=True):
        fork.state.step_s, fork.state.timed, fork.state.peak = steps, alone, peak
    return [_generation(fork, tokens, eos_token_ids) for fork, tokens in zip(forks, generated, strict=True)]


def _decode_steps(
    model: PreTrainedModel, forks: list[Fork], max_new_tokens: int, eos_token_ids: set[int]
) -> tuple[list[list[Tensor]], list[list[float]]]:
    """Greedy steps of `forks` in lockstep until every row of every fork has produced an
    end-of-sequence token, `max_new_tokens` tokens at most: each fork's tokens (its first included)
    and the time of each step it took part in."""
    device = forks[0].token.device
    timer, together = Timer(device), len(forks) > 1
    eos = torch.tensor(sorted(eos_token_ids), device=device, dtype=forks[0].token.dtype)
    tokens = [fork.token for fork in forks]
    generated = [[token][:max_new_tokens] for token in tokens]  # max_new_tokens=0: no token at all
    step_times: list[list[float]] = [[] for _ in forks]
    finished = [torch.zeros(token.shape[0], dtype=torch.bool, device=device) for token in tokens]
    active = list(range(len(forks)))
    for _ in range(max_new_tokens - 1):
        for i in active:
            finished[i] |= torch.isin(tokens[i][:, 0], eos)
        active = [i for i in active if not bool(finished[i].all())]
        if not active:
            break
        with timer.span() as step:
            if together:
                cache = ForkBatch([forks[i].cache for i in active])
                batch_tokens = torch.cat([tokens[i] for i in active])
            else:
                cache, batch_tokens = forks[0].cache, tokens[0]
            logits = model(batch_tokens, past_key_values=cache, logits_to_keep=1).logits
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
        for row, i in enumerate(active):
            tokens[i] = next_tokens[row : row + 1] if together else next_tokens
            generated[i].append(tokens[i])
            step_times[i].append(step.seconds)
    return generated, step_times


def _generation(fork: Fork, generated: list[Tensor], eos_token_ids: set[int]) -> Generation:
    """The fork's decoded run: its ids per row, cut after each row's first end-of-sequence token, and
    every measurement of its end (`fork.state` holds its decode steps by now)."""
    rows = fork.token.shape[0]
    ids = torch.cat(generated, dim=1).tolist() if generated else [[] for _ in range(rows)]
    if eos_token_ids:
        ids = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))] for row in ids]
    return Generation(ids, fork.cache.seq_lengths(), {**fork.measured, **measure(DECODED, fork.state)})


def generate_from(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method | str,
    budget: float,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    question_ids: Tensor | None = None,
    budget_unit: str | None = None,
) -> Generation:
    """Compress a fork of `prefilled` with (method, budget) and decode greedily, batch rows in lockstep.

    `question_ids` ([B, q]) are fed after compression with compression paused, and the first token
    follows them. `budget_unit`: "bytes" or "entries" (`centroidkv.cache.budget`; None: the prefill
    cache's, the default unit). Decoding stops when every row has produced an end-of-sequence token:
    `eos_token_ids` (an empty set never stops), by default the model's generation config.
    """
    fork = start_fork(model, prefilled, method, budget, max_new_tokens, question_ids, budget_unit)
    return decode_forks(model, [fork], max_new_tokens, eos_token_ids)[0]
