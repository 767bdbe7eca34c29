"""Compression as a function of tensors: one group of heads' entries in, `budget` entries out.

The first `n_sink` and the last `n_recent` entries are protected (kept as they are); the method
compresses the middle to what is left (`Method.compress`). Nothing here knows where the tensors come
from: the harness's cache (`centroidkv.cache.head_group`) calls it on a group's entries, and a serving
engine can call it on entries gathered from its blocks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from centroidkv.kv import LayerKV, LayerStats

if TYPE_CHECKING:
    from centroidkv.methods import Method


def compress_protected(
    kv: LayerKV, budget: int, method: Method, stats: LayerStats, n_sink: int, n_recent: int
) -> LayerKV:
    """`kv` [B, H, T, D] (T > budget) -> `budget` entries: sinks and recent window as they are, the
    middle compressed by `method` to budget - n_sink - n_recent entries.

    `stats` holds what the method may read besides the entries (the layer, its scaling, window
    records, the rotary table); its `keys`, `log_degree` and `middle` are filled here from `kv`, so
    query-aware methods see the whole group. Raises RuntimeError when the method returns another
    length than asked."""
    length = kv.length
    middle = slice(n_sink, length - n_recent)
    target = budget - n_sink - n_recent
    segment = LayerKV(
        kv.keys[:, :, middle],
        kv.values[:, :, middle],
        kv.log_degree[:, :, middle],
        {name: record[:, :, middle] for name, record in kv.extras.items()},
    )
    stats = dataclasses.replace(stats, keys=kv.keys, log_degree=kv.log_degree, middle=middle)
    kept = method.compress(segment, target, stats)
    if kept.length != target:
        raise RuntimeError(f"{method.name} returned {kept.length} tokens instead of {target}")

    def around(full: Tensor, new_middle: Tensor) -> Tensor:
        return torch.cat([full[:, :, :n_sink], new_middle, full[:, :, length - n_recent :]], dim=2)

    return LayerKV(
        around(kv.keys, kept.keys),
        around(kv.values, kept.values),
        around(kv.log_degree, kept.log_degree),
        {name: around(record, kept.extras[name]) for name, record in kv.extras.items()},
    )
