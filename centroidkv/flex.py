"""Degree-aware attention on fused kernels: FlexAttention for `+ log n`, flash-attn for degree-free prefill.

The reference path (`centroidkv.attention._biased_attention`) hands SDPA a materialised float bias
[B, H_kv, group * q, T]: the log-degrees plus a bottom-right causal mask. On a GPU that bias is an
extra tensor read per call and rules out the flash kernels. Here the same attention goes through

- FlexAttention (PyTorch >= 2.5) with a `score_mod` that adds the entry's log-degree and a block mask
  that is causal towards the bottom-right corner (the q new tokens are the last q entries), both
  compiled into one kernel; grouped-query heads map to their KV head inside the kernel (no copies);
- flash-attn's `flash_attn_func` when nothing is added (all degrees 1, i.e. the prefill and the full
  cache) and the package is importable (`pip install -e ".[gpu]"`); its causal mask is aligned
  bottom-right as well.

`backend` chooses: "auto" (the default: fused kernels on CUDA, SDPA elsewhere), "flex" (FlexAttention
on any device, eager on a CPU: the tests use it to compare with the reference) or "sdpa" (never fused).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

BACKENDS = ("auto", "flex", "sdpa")
_backend = "auto"


@contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """`with attention_backend("flex"): ...` forces a path for the block (tests, benchmarks)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def fused_attention(
    query: Tensor, key: Tensor, value: Tensor, log_degree: Tensor | None, scaling: float, dropout: float
) -> Tensor | None:
    """The fused path for this call ([B, q, Hq, D]), or None when the caller's SDPA path applies."""
    if dropout or _backend == "sdpa":
        return None
    if _backend == "flex":
        return flex_degree_attention(query, key, value, log_degree, scaling)
    if not query.is_cuda:
        return None
    if log_degree is None:
        # Degree-free: flash-attn for several queries when installed; SDPA's own kernels otherwise.
        if query.shape[2] > 1 and flash_attn_available() and query.dtype in (torch.float16, torch.bfloat16):
            return flash_prefill(query, key, value, scaling)
        return None
    return flex_degree_attention(query, key, value, log_degree, scaling) if flex_available() else None


def flex_degree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_degree: Tensor | None,
    scaling: float,
    compiled: bool | None = None,
) -> Tensor:
    """softmax(q k^T * scaling + log n) v with a bottom-right causal mask, as one FlexAttention call.

    query [B, Hq, q, D], key/value [B, H_kv, T, D], log_degree [B, H_kv, T] float32 or None
    -> [B, q, Hq, D] in the query's dtype. `compiled`: the fused kernel via torch.compile (default on
    CUDA); uncompiled, FlexAttention materialises the scores (a reference, fine for CPU tests).
    """
    from torch.nn.attention.flex_attention import flex_attention

    q_heads, q_len = query.shape[1], query.shape[2]
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    score_mod = None
    if log_degree is not None:
        # The KV head of each query head as a tensor: an integer captured by the closure becomes a
        # symbolic size under dynamic compilation, which the CPU code generator of torch 2.13 miscompiles.
        kv_head = torch.arange(q_heads, device=query.device) // group

        def score_mod(score, batch, head, q_idx, kv_idx):
            return score + log_degree[batch, kv_head[head], kv_idx]

    block_mask = _causal_block_mask(q_len, kv_len, query.device) if q_len > 1 else None
    attend = _compiled_flex() if (query.is_cuda if compiled is None else compiled) else flex_attention
    output = attend(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=group > 1
    )
    return output.transpose(1, 2).contiguous()


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once; dynamic shapes, since the cache length changes every step."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@functools.lru_cache(maxsize=8)  # every layer of one forward call asks for the same mask
def _causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len  # cached entries before the first new token

    def bottom_right_causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(bottom_right_causal, None, None, q_len, kv_len, device=device)


def flash_prefill(query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """Degree-free causal attention with flash-attn: [B, Hq, q, D] in, [B, q, Hq, D] out."""
    from flash_attn import flash_attn_func

    return flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True
    )
