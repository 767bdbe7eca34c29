"""Prefill once, then greedy-decode with any number of compressed forks of that prefill, timed.

TTFT = prefill + the fork's compression; TPOT = mean time of the decode steps after the first
(the first step is a warm-up and is excluded). On CUDA every timing point synchronises the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from centroidkv.cache import CompressedCache
from centroidkv.methods import Method


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Prefill:
    cache: CompressedCache  # the full, uncompressed cache of the prompt (never modified)
    first_token: Tensor  # [B, 1], argmax after the prompt
    seconds: float


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per batch row (first token included)
    ttft_s: float
    tpot_s: float
    compress_s: float
    kv_bytes: int
    seq_lengths: list[int]


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: Tensor,
    max_new_tokens: int,
    record_queries: int = 0,
    record_attention: bool = False,
) -> Prefill:
    """Run the prompt once with a full cache that records what query-aware methods need."""
    cache = CompressedCache(
        "full",
        budget=1.0,
        max_new_tokens=max_new_tokens,
        record_queries=record_queries,
        record_attention=record_attention,
    )
    start = _now(input_ids.device)
    logits = model(input_ids, past_key_values=cache, logits_to_keep=1).logits
    first_token = logits[:, -1].argmax(-1, keepdim=True)
    return Prefill(cache, first_token, _now(input_ids.device) - start)


@torch.inference_mode()
def generate_from(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method | str,
    budget: float,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
) -> Generation:
    """Compress a fork of `prefilled` with (method, budget) and decode greedily, batch rows in lockstep.

    Decoding stops when every row has produced an end-of-sequence token: `eos_token_ids`, or by
    default the model's generation config.
    """
    if eos_token_ids is None:
        configured = model.generation_config.eos_token_id
        eos_token_ids = set(
            configured if isinstance(configured, list) else [configured] if configured is not None else []
        )
    device = prefilled.first_token.device
    start = _now(device)
    cache = prefilled.cache.fork(method, budget, max_new_tokens)
    compress_s = _now(device) - start
    token = prefilled.first_token
    generated = [token]
    step_times = []
    finished = torch.zeros(token.shape[0], dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_token_ids), device=device, dtype=token.dtype)
    for _ in range(max_new_tokens - 1):
        finished |= torch.isin(token[:, 0], eos)
        if bool(finished.all()):
            break
        step_start = _now(device)
        token = model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        step_times.append(_now(device) - step_start)
        generated.append(token)
    timed = step_times[1:] or step_times
    ids = torch.cat(generated, dim=1).tolist()
    if eos.numel():  # cut each row after its first end-of-sequence token
        ids = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))] for row in ids]
    return Generation(
        tokens=ids,
        ttft_s=prefilled.seconds + compress_s,
        tpot_s=sum(timed) / len(timed) if timed else float("nan"),
        compress_s=compress_s,
        kv_bytes=cache.kv_bytes(),
        seq_lengths=cache.seq_lengths(),
    )
