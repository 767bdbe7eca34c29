"""The byte plan: entries per layer such that everything a cache stores is R times a full cache's bytes.

With `budget_unit="bytes"` (`centroidkv.budget`) a cache's layers keep B entries per compressed head,
B solved here so that what is stored right after a compression is at most R times the bytes of a full
cache of n + Gamma tokens, and one more entry per layer would exceed it. What is stored is a sum over
each layer's head groups (`centroidkv.head_group`):

  compressed heads   B entries: keys and values in the storage format, plus one float32 per record
  favoured heads     heads_boost x B entries (heads=budget), at most what they have seen
  heads kept whole   every token seen (heads=whole): keys and values, no records
  fixed              window records (e.g. SnapKV's last queries) of every query head not kept whole,
                     a hybrid model's window layers (their last W - 1 tokens) and the head ids of the
                     layers whose heads are split

Layers are alike (heads, head size, dtype), so one layer describes them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from centroidkv.budget import RECORD_BYTES, solve_entries
from centroidkv.heads import favoured_len

# centroidkv.cache's classes, named for the reader but not imported: that module imports this one, and
# the import picture has no circles (tests/test_import_cycles.py), type-only imports included.
CompressedCache = Any
CompressedLayer = Any


def solve_byte_plan(cache: CompressedCache, layer: CompressedLayer) -> list[int]:
    """B per layer for `cache` at the moment `layer` compresses (module docstring)."""
    batch, _, _, head_dim = layer.keys.shape
    n_heads = len(cache.layers[layer.layer_idx].head_lengths())  # every KV head of a layer
    entry_bytes = 2 * head_dim * layer.dtype.itemsize  # a key and a value of one head, model dtype
    n_records = len(cache.entry_needs) + (1 if cache.method.merges else 0)  # + the log-degree
    head_bytes = head_bytes_of(cache, head_dim, layer.dtype.itemsize, n_records)
    listed, kept = cache.heads_listed(), cache.heads_kept_whole()
    boosted = {} if kept else listed
    n_layers = cache.n_layers
    compressed_heads = [
        0 if index in cache.sliding_windows else n_heads - len(listed.get(index, ()))
        for index in range(n_layers)
    ]
    boosted_heads = [len(boosted.get(index, ())) for index in range(n_layers)]
    kept_bytes = (
        batch
        * sum(map(len, kept.values()))
        * (head_bytes(layer.n_seen) - RECORD_BYTES * n_records * layer.n_seen)
    )
    windows, fixed = (
        window_layer_bytes(cache, layer, n_heads, head_dim),
        fixed_bytes(cache, layer, n_heads, head_dim),
    )
    full_len = layer.prompt_len + cache.max_new_tokens
    reference_entries = sum(cache.layer_entries(index, full_len) for index in range(n_layers))
    target = int(cache.budget * batch * n_heads * entry_bytes * reference_entries)
    boost, method = cache.method.heads_boost, cache.method

    def stored_bytes(total: int) -> int:
        per_layer = [method.layer_budget(total, index, n_layers) for index in range(n_layers)]
        heads_bytes = sum(
            heads * head_bytes(length) for heads, length in zip(compressed_heads, per_layer, strict=True)
        )
        heads_bytes += sum(  # a favoured head stores what it has seen, at most its budget
            heads * head_bytes(min(layer.n_seen, favoured_len(length, boost, full_len)))
            for heads, length in zip(boosted_heads, per_layer, strict=True)
        )
        return windows + fixed + kept_bytes + batch * heads_bytes

    try:
        besides = stored_besides(cache, kept_bytes, fixed, windows)
        total = solve_entries(stored_bytes, target, full_len, besides)
    except ValueError as error:
        raise ValueError(f"{method.name} at budget {cache.budget:g} in bytes: {error}") from None
    return [method.layer_budget(total, index, n_layers) for index in range(n_layers)]


def stored_besides(cache: CompressedCache, kept_bytes: int, fixed: int, windows: int = 0) -> tuple[str, str]:
    """What a cache stores besides its compressed entries, in bytes, and what would lower it: heads
    kept whole, the window of recent queries (SnapKV's `window_size`), other fixed buffers, a hybrid
    model's window layers (nothing lowers theirs but the budget)."""
    window = sum(cache.window_needs.values())
    named = f"the window of the last {window} queries (window_size)" if window else "fixed buffers"
    layers = sorted(cache.sliding_windows)
    window_layers = f"the {len(layers)} sliding-window layers (layers {', '.join(map(str, layers))})"
    parts = [
        (name, int(size))
        for name, size in (("heads kept whole", kept_bytes), (named, fixed), (window_layers, windows))
        if size
    ]
    remedies = ["keep fewer heads whole"] if kept_bytes else []
    remedies += ["lower window_size"] if window and fixed else []
    remedy = ", ".join(remedies) if remedies or windows else "keep fewer heads whole"
    if len(parts) > 1:  # each part's share
        return "; ".join(f"{name}: {size} bytes" for name, size in parts), remedy
    return (parts[0][0] if parts else "nothing"), remedy


def head_bytes_of(
    cache: CompressedCache, head_dim: int, itemsize: int, n_records: int
) -> Callable[[int], float]:
    """Bytes of one head of `length` entries: keys and values (codes and residual, in the cache's
    storage format) and its records."""
    storage = cache.storage
    quantized_entry = storage.entry_bytes(head_dim, itemsize, quantized=True)
    stored_entry = storage.entry_bytes(head_dim, itemsize, quantized=False)

    def head_bytes(length: int) -> float:
        codes = storage.quantized_length(length)
        return codes * quantized_entry + (length - codes) * stored_entry + RECORD_BYTES * n_records * length

    return head_bytes


def window_layer_bytes(cache: CompressedCache, layer: CompressedLayer, n_heads: int, head_dim: int) -> int:
    """Bytes of a hybrid model's window layers (their last W - 1 tokens), stored whatever B is."""
    entry_bytes = 2 * head_dim * layer.dtype.itemsize
    seen = layer.n_seen
    return (
        layer.keys.shape[0]
        * n_heads
        * entry_bytes
        * sum(cache.layer_entries(i, seen) for i in cache.sliding_windows)
    )


def fixed_bytes(cache: CompressedCache, layer: CompressedLayer, n_heads: int, head_dim: int) -> int:
    """Bytes stored whatever B is besides the window layers (`window_layer_bytes`): window records and
    head ids (module docstring)."""
    batch, itemsize, windows = layer.keys.shape[0], layer.dtype.itemsize, cache.sliding_windows
    kept = cache.heads_kept_whole()
    # (the model's query group: a plan solved before the first attention call knows it too)
    query_group = cache.query_group or layer.query_group
    window_rows = sum(
        query_group * (n_heads - len(kept.get(index, ())))
        for index in range(cache.n_layers)
        if index not in windows
    )
    total = batch * window_rows * sum(cache.window_needs.values()) * head_dim * itemsize
    id_bytes = torch.empty((), dtype=torch.long).element_size()
    return total + n_heads * id_bytes * sum(map(bool, cache.heads_listed().values()))
