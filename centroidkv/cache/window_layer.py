"""Sliding-window layers of hybrid models (Gemma 3, Qwen2 with `use_sliding_window`, ...).

A hybrid model attends over its whole context in some layers and over the last W tokens in the others
(`config.layer_types`, `config.sliding_window`). A window layer already holds a small, fixed cache, so
a compressed cache leaves it as transformers' own cache does: it keeps the last W - 1 entries between
forward passes (the W-th is the next token), never merges or evicts by a method, stores them in the
model's dtype, and its bytes count in the budget (`CompressedCache` solves B over the layers it
compresses, the window layers' bytes fixed).

Its attention is `window_attention`: each query sees the keys of the last W positions up to its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from centroidkv.cache.cache import CompressedCache, CompressedLayer
from centroidkv.cache.planner import GroupPlanner

SLIDING = "sliding_attention"  # transformers' name of a window layer in `config.layer_types`


def sliding_windows(config) -> dict[int, int]:
    """{layer index: W} for the window layers of a model configuration (empty for a model without)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if not window:
        return {}
    return {index: int(window) for index, kind in enumerate(layer_types) if kind == SLIDING}


class WindowLayer(CompressedLayer):
    """A window layer's entries: the last `window - 1` tokens' keys and values (module docstring), one
    head group of role "window" (`centroidkv.cache.head_group`: no records, the model's dtype,
    buffers of W)."""

    compresses = False
    main_role = "window"

    def __init__(self, layer_idx: int, window: int):
        super().__init__(layer_idx)
        self.window = window

    def check_planned_room(self, planner: GroupPlanner) -> None:
        """Nothing to check: a window layer is never compressed."""

    def after_attention(
        self, planner: GroupPlanner, query: Tensor, scaling: float, received: Tensor | None = None
    ) -> None:
        """Drop what the next token will not see: keep the last `window - 1` entries, in a buffer of
        their own (a slice would keep the whole prompt's tensors alive)."""
        self.scaling = scaling
        keep, group = self.window - 1, self.main
        self.query_group = query.shape[1] // max(1, group.keys.shape[1])
        if group.length <= keep:
            return
        for slot in ("keys", "values"):
            live = getattr(group, slot)
            group.store_new(slot, live[:, :, live.shape[2] - keep :], self.window)


CompressedCache.window_layer_class = WindowLayer


def window_attention(query: Tensor, key: Tensor, value: Tensor, window: int, scaling: float | None) -> Tensor:
    """Causal attention over the last `window` positions: query [B, Hq, q, D] (the last q of the kv_len
    entries, which are consecutive tokens), key/value [B, Hkv, kv_len, D] -> output [B, q, Hq, D].
    Query i sees key j when j <= i's position and i's position - j < window (transformers' mask)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    if q_len == 1 and kv_len <= window:  # a decode step that sees every kept entry
        output = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=group > 1)
        return output.transpose(1, 2).contiguous()
    query_pos = torch.arange(kv_len - q_len, kv_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(kv_len, device=query.device).unsqueeze(0)
    allowed = (key_pos <= query_pos) & (query_pos - key_pos < window)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=group > 1
    )
    return output.transpose(1, 2).contiguous()
