"""Degree-aware attention, registered with transformers' attention-function interface.

A cached entry of degree n stands for n original tokens, so its logit gets + log n:
softmax(q k^T / sqrt(d) + log n). For n exact duplicates this is exact: one entry with weight n
equals n identical entries. With all degrees 1 the function is plain causal SDPA.

The function reaches its cache layer through `module.kv_layer`, set before every attention call by a
forward pre-hook that reads the `past_key_values` argument (no model forward is copied or patched).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from centroidkv.cache import CompressedCache, causal_allowed

ATTN_IMPLEMENTATION = "centroidkv"


def degree_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [B, Hq, q, D], key/value [B, Hkv, T, D] -> output [B, q, Hq, D].

    The q new tokens are the last q entries of the cache, so the causal mask is aligned to the
    bottom-right corner (physical lengths differ from positions once the cache is compressed).
    The argument order is transformers' own (`dropout` before `scaling`): wrappers such as kvpress's
    pass them positionally.
    """
    if attention_mask is not None:
        raise NotImplementedError(
            "centroidkv attention builds its own causal mask; custom masks are not supported"
        )
    layer = getattr(module, "kv_layer", None)
    q_len, head_dim = query.shape[2], query.shape[3]
    kv_len, group = key.shape[2], query.shape[1] // key.shape[1]
    log_degree = None if layer is None else layer.log_degree
    if log_degree is None and (q_len == 1 or q_len == kv_len):
        # All degrees 1 and no offset between queries and keys: SDPA's own causal / GQA path.
        output = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=q_len > 1, scale=scaling, enable_gqa=group > 1
        )
        output = output.transpose(1, 2).contiguous()
    else:
        output = _biased_attention(query, key, value, log_degree, scaling, dropout)
    if layer is not None:
        layer.after_attention(query, scaling if scaling is not None else head_dim**-0.5)
    return output, None


def _biased_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_degree: Tensor | None,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """SDPA with an additive bias: + log_degree, and a bottom-right causal mask when q > 1."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    # An additive bias rules out SDPA's GQA path; rather than copying keys to every query head,
    # fold each KV head's query heads into its rows: [B, Hkv, group * q, D], rows ordered (group, q).
    grouped_query = query.reshape(batch, kv_heads, group * q_len, head_dim)
    bias = None
    if log_degree is not None:
        bias = log_degree.to(query.dtype).unsqueeze(2)  # [B, Hkv, 1, T], broadcast over the rows
    if q_len > 1:
        allowed = causal_allowed(q_len, kv_len, query.device).repeat(group, 1)
        causal = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        causal.masked_fill_(~allowed, torch.finfo(query.dtype).min)
        bias = causal if bias is None else bias + causal
    output = F.scaled_dot_product_attention(
        grouped_query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).contiguous()


def no_padding_mask(*, attention_mask: Tensor | None = None, **kwargs) -> None:
    """Mask function for our implementation: the attention builds the causal mask itself.

    A padding mask cannot be honoured once entries are merged (columns no longer map to tokens), so
    padded batches are refused instead of silently mis-masked.
    """
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "padded batches are not supported: use equal-length prompts or batch size 1"
        )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, degree_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_padding_mask)


def _bind_cache_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
    cache = kwargs.get("past_key_values")
    if isinstance(cache, CompressedCache) and module.config._attn_implementation == ATTN_IMPLEMENTATION:
        cache.n_layers = module.config.num_hidden_layers
        module.kv_layer = cache.layer(module.layer_idx)
    else:
        module.kv_layer = None


def _unbind_cache_layer(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    module.kv_layer = None  # the model must not keep the last cache alive


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Switch a loaded model to degree-aware attention and hook its attention modules (idempotent)."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if getattr(model, "_centroidkv_prepared", False):
        return model
    attention_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not attention_modules:
        raise ValueError(f"{type(model).__name__}: no attention modules with a layer_idx were found")
    for module in attention_modules:
        module.register_forward_pre_hook(_bind_cache_layer, with_kwargs=True)
        module.register_forward_hook(_unbind_cache_layer, with_kwargs=True)
    model._centroidkv_prepared = True
    return model
