"""Heads kept whole (`heads="whole"`): which KV heads, the byte budget over both parts, and the
per-request side store that holds their entries.

The harness's CentroidKV keeps a calibrated list of (layer, KV head) pairs whole (every token, never
merged: `centroidkv.head_policy`) and compresses the other heads to B entries, B solved so that both
parts together store R times a full cache of n + Gamma tokens (`centroidkv.cache.byte_plan.solve`, called
here with the same shape the harness's cache describes; the heads kept whole grow while decoding, so
B is solved again at every compression, as in the harness).

vLLM's paged pool holds every KV head of a layer in each block, so a block cannot hold a whole head
beside compressed ones. The listed heads' entries therefore live in a `SideStore` per request: dense
[h, length, D] keys and values per layer that lists heads, filled from the pool at the request's first
compression (the pool then still holds every token), appended every step afterwards, and dropped
with the request's state (`centroidkv_vllm.tracker`). In the pool the listed heads' slots of the
compressed positions are written with zeros and never read again; the attention computes the listed
heads of a compressed request from its side store (`centroidkv_vllm.backend`).

The scheduler counts the side store in blocks (`HeadLayout.reserved_blocks`): a compressed request
keeps, of the blocks before its kept start, as many as the side store's bytes at n + Gamma tokens
take in the pool (a block id's bytes over all layers), so that admission sees what it holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from centroidkv_vllm.config import CentroidConfig


@dataclass(frozen=True)
class HeadLayout:
    """What the byte plan and the side store need to know of the served model (hashable: it rides in
    the scheduler's `CentroidSpec`)."""

    listed: tuple[tuple[int, ...], ...]  # per layer (model order), the KV heads kept whole
    n_kv_heads: int
    head_dim: int
    itemsize: int  # bytes of one cache element (the model's dtype)
    query_group: int  # query heads per KV head

    @property
    def n_layers(self) -> int:
        return len(self.listed)

    @property
    def n_listed(self) -> int:
        return sum(map(len, self.listed))

    def side_bytes(self, tokens: int) -> int:
        """Bytes of a side store holding `tokens` entries of every listed head (keys and values)."""
        return tokens * self.n_listed * 2 * self.head_dim * self.itemsize

    def reserved_blocks(self, tokens: int, block_bytes: int) -> int:
        """Blocks of `block_bytes` (one block id over all layers) that a side store of `tokens`
        entries takes."""
        return math.ceil(self.side_bytes(tokens) / block_bytes)

    def budget_at(self, config: CentroidConfig, prompt_len: int) -> Callable[[int], int]:
        """B of a compression at computed length `seen` (a function of `seen`, cached), for a request
        whose prompt (anchor) is `prompt_len`: `centroidkv.cache.byte_plan.solve` on the shape the harness's
        `CompressedCache.byte_shape` builds (batch 1, no window layers)."""
        from centroidkv.cache.byte_plan import ByteShape, solve
        from centroidkv.head_policy import HeadPolicy
        from centroidkv.needs import RECORDERS, gather_needs
        from centroidkv.storage_precision import StoragePrecision

        method = config.method()
        recorded = gather_needs(method.needs())
        entry_needs = [name for name in recorded if not RECORDERS[name].window]
        window_records = sum(size for name, size in recorded.items() if RECORDERS[name].window)
        policy = HeadPolicy.of(method)

        @functools.cache
        def budget(seen: int) -> int:
            shape = ByteShape(
                batch=1,
                n_heads=self.n_kv_heads,
                head_dim=self.head_dim,
                itemsize=self.itemsize,
                n_records=len(entry_needs) + (1 if method.merges else 0),
                storage=StoragePrecision.of(method).storage,
                listed=tuple(map(len, self.listed)),
                listed_whole=policy.listed_whole,
                heads_boost=policy.heads_boost,
                windows=(None,) * self.n_layers,
                n_seen=seen,
                prompt_len=prompt_len,
                max_new_tokens=config.max_new_tokens,
                budget=config.budget,
                query_group=self.query_group,
                window_records=window_records,
                layer_budget=method.layer_budget,
                method_name=method.name,
            )
            per_layer = solve(shape)
            if len(set(per_layer)) != 1:  # the pool frees blocks by one kept start for every layer
                raise ValueError(f"centroidkv: per-layer budgets {sorted(set(per_layer))} are not supported")
            return per_layer[0]

        return budget


def listed_heads(config: CentroidConfig, model: str, n_layers: int, n_kv_heads: int) -> dict[int, list[int]]:
    """The KV heads per layer that `config`'s head policy lists on the served `model` (a folder), by
    the harness's own reading of the head file (`centroidkv.calibrate.listed_heads_for`: the worst
    `heads_fraction` by the file's score). A score name (the default "clustering") is looked up for the
    folder, then for its name (the converted models' folders are named after the registered model)."""
    if config.heads == "none":
        return {}
    from centroidkv.calibrate import HEAD_SCORES, head_file_for, listed_heads_for
    from centroidkv.head_policy import HeadPolicy

    policy = HeadPolicy.of(config.method())
    name = str(model)
    if str(config.heads_file) in HEAD_SCORES and head_file_for(name, config.heads_file) is None:
        name = Path(model).name
    shape = SimpleNamespace(num_hidden_layers=n_layers, num_key_value_heads=n_kv_heads)
    served = SimpleNamespace(centroidkv_name=name, config=shape)
    return listed_heads_for(served, policy.heads_file, policy.heads_fraction)


def head_layout(config: CentroidConfig | None, vllm_config: Any, dtype: torch.dtype) -> HeadLayout | None:
    """The served model's `HeadLayout` under `config`, None when no head is kept whole."""
    if config is None or config.heads == "none":
        return None
    model_config = vllm_config.model_config
    text = model_config.hf_text_config
    n_layers = int(text.num_hidden_layers)
    n_kv_heads = model_config.get_total_num_kv_heads()
    listed = listed_heads(config, model_config.model, n_layers, n_kv_heads)
    if not listed:
        return None
    n_query = int(text.num_attention_heads)
    return HeadLayout(
        listed=tuple(tuple(listed.get(index, ())) for index in range(n_layers)),
        n_kv_heads=n_kv_heads,
        head_dim=model_config.get_head_size(),
        itemsize=dtype.itemsize,
        query_group=n_query // n_kv_heads,
    )


class SideStore:
    """One request's entries of the heads kept whole: per layer index, keys and values [h, length, D]
    in buffers with room to grow (module docstring)."""

    def __init__(self, headroom: int):
        self.headroom = headroom  # extra entries allocated beyond the current length
        self.layers: dict[int, list] = {}  # layer index -> [keys buffer, values buffer, length]

    def has(self, layer: int) -> bool:
        return layer in self.layers

    def start(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """The layer's listed heads' entries [h, L, D] of positions 0..L-1 (read from the pool)."""
        length = keys.shape[1]
        buffers = [t.new_empty(t.shape[0], length + self.headroom, t.shape[2]) for t in (keys, values)]
        buffers[0][:, :length], buffers[1][:, :length] = keys, values
        self.layers[layer] = [*buffers, length]

    def append(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """The step's new entries [h, t, D] at the end."""
        entry = self.layers[layer]
        length, added = entry[2], keys.shape[1]
        if length + added > entry[0].shape[1]:  # full: grow by the headroom again
            for index in (0, 1):
                old = entry[index]
                grown = old.new_empty(old.shape[0], length + added + self.headroom, old.shape[2])
                grown[:, :length] = old[:, :length]
                entry[index] = grown
        entry[0][:, length : length + added] = keys
        entry[1][:, length : length + added] = values
        entry[2] = length + added

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        keys, values, length = self.layers[layer]
        return keys[:, :length], values[:, :length]
