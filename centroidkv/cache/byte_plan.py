"""The byte plan: entries per layer such that everything a cache stores is R times a full cache's bytes.

With `budget_unit="bytes"` (`centroidkv.cache.budget`) a cache's layers keep B entries per compressed head,
B solved here so that what is stored right after a compression is at most R times the bytes of a full
cache of n + Gamma tokens, and one more entry per layer would exceed it. What is stored is a sum over
each layer's head groups (`centroidkv.cache.head_group`):

  compressed heads   B entries: keys and values in the storage format, plus one float32 per record
  favoured heads     heads_boost x B entries (heads=budget), at most what they have seen
  heads kept whole   every token seen (heads=whole): keys and values, no records
  fixed              window records (e.g. SnapKV's last queries) of every query head not kept whole,
                     a hybrid model's window layers (their last W - 1 tokens) and the head ids of the
                     layers whose heads are split

The plan does not add up what the groups hold now: it computes what each kind of head would store for
a candidate B, from a frozen record of the cache's shape (`ByteShape`: sizes, counts, settings; no
tensor, no cache), and solves for B. So `solve` is a pure function that a cache calls once per
compression, with a shape it builds itself, and that a test can call with any shape. Layers are alike
(heads, head size, dtype), so one head size and one head count describe them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from centroidkv.cache.budget import RECORD_BYTES, solve_entries
from centroidkv.cache.quantization import StorageFormat
from centroidkv.head_policy import favoured_len

ID_BYTES = torch.empty((), dtype=torch.long).element_size()  # one stored head id


@dataclass(frozen=True, slots=True)
class ByteShape:
    """What the byte plan depends on, at the moment a layer compresses (module docstring)."""

    batch: int
    n_heads: int  # KV heads per layer
    head_dim: int
    itemsize: int  # bytes of one element in the model's dtype
    n_records: int  # float32 records per entry of a compressed head (entry records and log-degree)
    storage: StorageFormat  # how keys and values are stored
    listed: tuple[int, ...]  # heads the head policy lists, per layer
    listed_whole: bool  # whether the listed heads are kept whole (else favoured: heads_boost x B)
    heads_boost: float
    windows: tuple[int | None, ...]  # each layer's sliding window W (None: a layer compressed to B)
    n_seen: int  # tokens the compressing layer has seen
    prompt_len: int  # n
    max_new_tokens: int  # Gamma
    budget: float  # R
    query_group: int  # query heads per KV head
    window_records: int  # rows of window records kept per query head (e.g. SnapKV's window_size)
    layer_budget: Callable[[int, int, int], int]  # the method's B per layer (PyramidKV's pyramid)
    method_name: str  # for messages

    @property
    def n_layers(self) -> int:
        return len(self.windows)

    def kept(self, layer_idx: int) -> int:
        """Heads kept whole in `layer_idx`."""
        return self.listed[layer_idx] if self.listed_whole else 0


def full_entries(window: int | None, length: int) -> int:
    """Entries per head a full cache holds in a layer after `length` tokens: all of them, or the last
    W - 1 in a window layer (transformers' own sliding-window cache)."""
    return length if window is None else min(length, window - 1)


def solve(shape: ByteShape) -> list[int]:
    """B per layer for a cache of `shape` (module docstring)."""
    n_layers, seen = shape.n_layers, shape.n_seen
    entry_bytes = 2 * shape.head_dim * shape.itemsize  # a key and a value of one head, model dtype
    head_bytes = head_bytes_of(shape)
    compressed_heads = [
        0 if shape.windows[index] is not None else shape.n_heads - shape.listed[index]
        for index in range(n_layers)
    ]
    boosted_heads = [0 if shape.listed_whole else count for count in shape.listed]
    kept_heads = sum(shape.kept(index) for index in range(n_layers))
    kept_bytes = shape.batch * kept_heads * (head_bytes(seen) - RECORD_BYTES * shape.n_records * seen)
    windows, fixed = window_layer_bytes(shape), fixed_bytes(shape)
    full_len = shape.prompt_len + shape.max_new_tokens
    reference_entries = sum(full_entries(window, full_len) for window in shape.windows)
    target = int(shape.budget * shape.batch * shape.n_heads * entry_bytes * reference_entries)
    boost, layer_budget = shape.heads_boost, shape.layer_budget

    def stored_bytes(total: int) -> int:
        per_layer = [layer_budget(total, index, n_layers) for index in range(n_layers)]
        heads_bytes = sum(
            heads * head_bytes(length) for heads, length in zip(compressed_heads, per_layer, strict=True)
        )
        heads_bytes += sum(  # a favoured head stores what it has seen, at most its budget
            heads * head_bytes(min(seen, favoured_len(length, boost, full_len)))
            for heads, length in zip(boosted_heads, per_layer, strict=True)
        )
        return windows + fixed + kept_bytes + shape.batch * heads_bytes

    try:
        besides = stored_besides(shape, kept_bytes, fixed, windows)
        total = solve_entries(stored_bytes, target, full_len, besides)
    except ValueError as error:
        raise ValueError(f"{shape.method_name} at budget {shape.budget:g} in bytes: {error}") from None
    return [layer_budget(total, index, n_layers) for index in range(n_layers)]


def stored_besides(shape: ByteShape, kept_bytes: int, fixed: int, windows: int = 0) -> tuple[str, str]:
    """What a cache stores besides its compressed entries, in bytes, and what would lower it: heads
    kept whole, the window of recent queries (SnapKV's `window_size`), other fixed buffers, a hybrid
    model's window layers (nothing lowers theirs but the budget)."""
    window = shape.window_records
    named = f"the window of the last {window} queries (window_size)" if window else "fixed buffers"
    layers = [index for index, size in enumerate(shape.windows) if size is not None]
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


def head_bytes_of(shape: ByteShape) -> Callable[[int], float]:
    """Bytes of one head of `length` entries: keys and values (codes and residual, in the storage
    format) and its records."""
    storage, head_dim, itemsize = shape.storage, shape.head_dim, shape.itemsize
    quantized_entry = storage.entry_bytes(head_dim, itemsize, quantized=True)
    stored_entry = storage.entry_bytes(head_dim, itemsize, quantized=False)

    def head_bytes(length: int) -> float:
        codes = storage.quantized_length(length)
        return (
            codes * quantized_entry
            + (length - codes) * stored_entry
            + RECORD_BYTES * shape.n_records * length
        )

    return head_bytes


def window_layer_bytes(shape: ByteShape) -> int:
    """Bytes of a hybrid model's window layers (their last W - 1 tokens), stored whatever B is."""
    entry_bytes = 2 * shape.head_dim * shape.itemsize
    window_entries = sum(full_entries(window, shape.n_seen) for window in shape.windows if window is not None)
    return shape.batch * shape.n_heads * entry_bytes * window_entries


def fixed_bytes(shape: ByteShape) -> int:
    """Bytes stored whatever B is besides the window layers (`window_layer_bytes`): window records and
    head ids (module docstring)."""
    window_rows = sum(
        shape.query_group * (shape.n_heads - shape.kept(index))
        for index in range(shape.n_layers)
        if shape.windows[index] is None
    )
    total = shape.batch * window_rows * shape.window_records * shape.head_dim * shape.itemsize
    return total + shape.n_heads * ID_BYTES * sum(map(bool, shape.listed))
