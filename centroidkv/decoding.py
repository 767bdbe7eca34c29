"""Prefill once, then greedy-decode with any number of compressed forks of that prefill, timed.

`prefill` runs the prompt with a full cache (recording what query-aware methods need);
`generate_from` forks it with a (method, budget), compresses, optionally feeds more tokens with
compression paused (the question, in the context-only protocol), and decodes greedily.
TTFT = prefill + the fork's compression + the fed tokens; TPOT = mean time of the decode steps
after the first (the first step is a warm-up and is excluded when there are more).
Times come from CUDA events on a GPU and `perf_counter` on a CPU (`Timer`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from centroidkv.cache import CompressedCache
from centroidkv.methods import Method
from centroidkv.needs import Need


@dataclass
class Span:
    seconds: float = 0.0


class Timer:
    """`with Timer(device).span() as span: ...` -> span.seconds. On CUDA the block is bracketed by
    events and the end event is synchronised, so asynchronous kernels are counted."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    @contextmanager
    def span(self) -> Iterator[Span]:
        result = Span()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield result
            end.record()
            end.synchronize()
            result.seconds = start.elapsed_time(end) / 1000.0
        else:
            start_time = time.perf_counter()
            yield result
            result.seconds = time.perf_counter() - start_time


@dataclass
class Prefill:
    cache: CompressedCache  # the full, uncompressed cache of the prompt (never modified)
    first_token: Tensor  # [B, 1], argmax after the prompt
    seconds: float


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per batch row (first token included, cut after an eos)
    ttft_s: float  # prefill + compression + fed tokens
    tpot_s: float  # mean decode step after the first (nan when there was no step)
    compress_s: float
    feed_s: float  # the tokens fed after compression (0 when none)
    decode_s: float  # all decode steps
    n_decode_steps: int
    kv_bytes_compressed: int  # right after compression (and the fed tokens)
    kv_bytes: int  # at the end of decoding
    kv_capacity_bytes: int  # at the end of decoding: the buffers behind kv_bytes, headroom included
    kv_ratio: float  # right after compression: bytes stored / bytes of the full cache of those tokens
    budget_ratio: float  # right after compression: bytes stored / bytes of a full cache of n + Gamma tokens
    seq_lengths: list[int]  # entries per layer at the end
    n_compressions: int


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: Tensor,
    max_new_tokens: int,
    needs: Iterable[Need] = (),
) -> Prefill:
    """Run the prompt once with a full cache that records `needs` (e.g. `needs_of(methods)`)."""
    if input_ids.shape[-1] == 0:
        raise ValueError("prefill needs at least one prompt token, got an empty prompt")
    cache = CompressedCache("full", budget=1.0, max_new_tokens=max_new_tokens, needs=needs)
    with Timer(input_ids.device).span() as span:
        logits = model(input_ids, past_key_values=cache, logits_to_keep=1).logits
        first_token = logits[:, -1].argmax(-1, keepdim=True)
    return Prefill(cache, first_token, span.seconds)


def needs_of(methods: Iterable[Method]) -> list[Need]:
    """Everything a prefill must record so that it can be forked to each of `methods`."""
    return [need for method in methods for need in method.needs()]


def default_eos(model: PreTrainedModel) -> set[int]:
    configured = model.generation_config.eos_token_id
    return set(configured if isinstance(configured, list) else [] if configured is None else [configured])


@torch.inference_mode()
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
    follows them. `budget_unit`: "bytes" or "entries" (`centroidkv.budget`; None: the prefill
    cache's, the default unit). Decoding stops when every row has produced an end-of-sequence token:
    `eos_token_ids` (an empty set never stops), by default the model's generation config.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    eos_token_ids = default_eos(model) if eos_token_ids is None else eos_token_ids
    device = prefilled.first_token.device
    timer = Timer(device)
    with timer.span() as compressing:
        cache = prefilled.cache.fork(method, budget, max_new_tokens, budget_unit=budget_unit)
    budget_ratio = cache.budget_ratio()  # before the question: what the compression kept
    token, feed_s = prefilled.first_token, 0.0
    if question_ids is not None and question_ids.shape[1]:
        with timer.span() as feeding, cache.paused():
            logits = model(question_ids, past_key_values=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        feed_s = feeding.seconds
    kv_bytes_compressed, kv_ratio = cache.kv_bytes(), cache.kv_ratio()
    cache.check_room(max_new_tokens - 1)  # a budget too small for the protected tokens fails before decoding

    generated = [token][:max_new_tokens]  # max_new_tokens=0: no token at all
    step_times: list[float] = []
    finished = torch.zeros(token.shape[0], dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_token_ids), device=device, dtype=token.dtype)
    for _ in range(max_new_tokens - 1):
        finished |= torch.isin(token[:, 0], eos)
        if bool(finished.all()):
            break
        with timer.span() as step:
            logits = model(token, past_key_values=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        step_times.append(step.seconds)
        generated.append(token)
    timed = step_times[1:] or step_times
    ids = torch.cat(generated, dim=1).tolist() if generated else [[] for _ in range(token.shape[0])]
    if eos_token_ids:  # cut each row after its first end-of-sequence token
        ids = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))] for row in ids]
    return Generation(
        tokens=ids,
        ttft_s=prefilled.seconds + compressing.seconds + feed_s,
        tpot_s=sum(timed) / len(timed) if timed else float("nan"),
        compress_s=compressing.seconds,
        feed_s=feed_s,
        decode_s=sum(step_times),
        n_decode_steps=len(step_times),
        kv_bytes_compressed=kv_bytes_compressed,
        kv_bytes=cache.kv_bytes(),
        kv_capacity_bytes=cache.kv_capacity_bytes(),
        kv_ratio=kv_ratio,
        budget_ratio=budget_ratio,
        seq_lengths=cache.seq_lengths(),
        n_compressions=cache.n_compressions,
    )


def own_prefill(
    model: PreTrainedModel, method: Method, budget: float, context_ids: Tensor, max_new_tokens: int
) -> Prefill:
    """The prefill of a method that compresses inside its own prefill forward (kvpress's presses,
    `method.compresses_in_prefill`): the context runs with the method's hooks active, so the returned
    cache is already compressed and the compression time is part of `Prefill.seconds`. Such a method
    cannot fork a shared prefill; continue with `generate_after_own_prefill`.
    (The budget's B is the same in both units: a press's cache stores keys and values only.)"""
    with method.prefill_hooks(model, budget, context_ids.shape[-1], max_new_tokens):
        return prefill(model, context_ids, max_new_tokens)


def generate_after_own_prefill(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method,
    budget: float,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    question_ids: Tensor | None = None,
) -> Generation:
    """Feed the question and decode greedily on the cache `own_prefill` compressed, with the method's
    decoding hooks active (no fork, no further compression by the cache)."""
    with method.decoding_hooks(model, budget):
        return generate_from(
            model,
            prefilled,
            "full",
            1.0,
            max_new_tokens,
            eos_token_ids=eos_token_ids,
            question_ids=question_ids,
        )


def chat_prompt_ids(
    tokenizer,
    user_message: str,
    question: str | None = None,
    context_only: bool = False,
    answer_prefix: str = "",
    use_chat_template: bool = True,
) -> tuple[list[int], list[int]]:
    """Token ids of a prompt as (the part to prefill, the part fed after compression).

    The chat template (when the tokenizer has one and `use_chat_template`) wraps `user_message` as
    the user's turn and adds the assistant's generation prompt; `answer_prefix` follows. With
    `context_only`, the text from the last occurrence of `question` on is the second part (the
    context-only protocol); otherwise the second part is empty (the full-prompt protocol).
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = user_message
    text += answer_prefix or ""
    split = len(text)
    if context_only and question:
        found = text.rfind(question)
        if found > 0:
            split = found
    head = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    tail = tokenizer(text[split:], add_special_tokens=False)["input_ids"] if split < len(text) else []
    return head, tail


def warm_up(
    model: PreTrainedModel, methods: Iterable[Method | str] = ("centroidkv",), prompt_len: int = 256
) -> float:
    """Pay a process's one-time costs before timing anything: one tiny prefill, then a compressed
    fork + a few decode steps per method (default: CentroidKV, whose first compression in a process
    is several times slower than the next ones). Returns the seconds it took. The runner does the
    same per job (`warmup: true`)."""
    from centroidkv.methods import get_method  # the registry, at call time (methods may be added late)

    start = time.perf_counter()
    built = [get_method(m) if isinstance(m, str) else m for m in methods]
    device = next(model.parameters()).device
    ids = (torch.arange(prompt_len, device=device) % (model.config.vocab_size - 10) + 10)[None]
    shared = [m for m in built if not m.compresses_in_prefill]
    prefilled = prefill(model, ids, 4, needs=needs_of(shared))
    for method in built:
        if method.compresses_in_prefill:
            own = own_prefill(model, method, 0.5, ids, 4)
            generate_after_own_prefill(model, own, method, 0.5, 4, eos_token_ids=set())
        else:
            generate_from(model, prefilled, method, 0.5, 4, eos_token_ids=set())
    return time.perf_counter() - start
