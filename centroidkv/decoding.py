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
