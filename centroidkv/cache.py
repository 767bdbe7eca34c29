"""The compressed KV cache: keys, values and log-degrees per layer, and the paper's budget policy.

Budget (docs/method.md, section 2; `centroidkv.budget`): B entries per layer, from the budget ratio R,
the prompt length n and the maximum number of new tokens Gamma. With `budget_unit="entries"` (the
paper's accounting) B = R * (n + Gamma); with `budget_unit="bytes"` (the default) B is solved so that
everything the cache stores (`kv_bytes()`: entries, degrees, entry records, heads kept whole) is R times
the bytes of a full cache of n + Gamma tokens. After the prefill forward the cache is compressed to B
when n > B; while decoding it is compressed back to B whenever it reaches B + g (g = the method's
`compress_interval`). The first `n_sink` and last `n_recent` tokens are never given to the method; for a
prompt too short for them at the budget, the recent window, then the sinks, shrink to what the budget
leaves (`centroidkv.budget.fit_protected`), and `protected_used()` records the windows kept.

Compression happens at the end of each layer's attention call (the attention function calls
`CompressedLayer.after_attention`), so the prefill attention always sees the full prompt and a
layer's full-size tensors are released as soon as that layer is done. Tensors are replaced by
smaller ones: memory shrinks for real.

What a method needs recorded (accumulated attention, query windows, positions) is declared by the
method and kept by one mechanism (`centroidkv.needs`).

Layout of one layer (`CompressedLayer`):
  keys, values     [B, H_c, T, D]   the compressed KV heads (every head unless the method keeps some whole)
  log_degree       [B, H_c, T]      float32 log of each entry's degree (None while all degrees are 1)
  extras[name]     [B, H_c, T]      entry records, aligned with the entries (float32)
  windows[name]    [B, H_q, w, ...] window records (e.g. the last w queries): every query head, or
                                    after a head policy's split the query heads of this group
  whole_keys/values [B, H_o, n, D]  heads=whole: the listed KV heads (`centroidkv.heads`), every token
                                    seen, never compressed; `whole_heads` [H_o] and
                                    `compressed_heads` [H_c] give the KV head ids of the two groups.
  favoured          a CompressedLayer  heads=budget: the listed KV heads (`favoured_heads` [H_f]), a
                                    layer of their own with the same machinery (entries, degrees,
                                    records, windows, compression) and a budget of heads_boost x B.
The heads are split at a layer's first compression, only when the method's head policy lists heads
for it; until then (and under heads=none) keys/values hold all heads and the rest is None. After the
split, window records hold the query heads of their group's KV heads only, so a method that reads
them sees the statistics of the heads it compresses. The attention function runs the groups
separately (a query head attends to its KV head's group).
In entries, heads kept whole are on top of the budget B, which applies to the compressed heads (as in
the paper), and favoured heads keep heads_boost x B; in bytes, both are paid for by the other heads.
`kv_bytes()` counts every stored tensor; `kv_ratio()` relates it to a full cache of the tokens seen,
`budget_ratio()` to the budget's reference, a full cache of n + Gamma tokens.

Decoding writes in place. Every growing tensor (keys, values, log-degrees, entry records, whole
heads) is the live prefix `buffer[:, :, :length]` of a preallocated buffer with headroom, so a decode
step copies one token into the buffer instead of `torch.cat`-ing the whole cache:
  - a compression writes its result into a new buffer of B + g entries (g = `compress_interval`),
    exactly what is needed until the next compression;
  - otherwise (the full cache, heads kept whole) a cache's first buffer has room for the
    max_new_tokens it was planned for, and buffers grow geometrically (x2) past that.
Buffers are never shared: a fork starts from the source's live views and allocates its own buffer on
its first write, and a tensor replaced from outside (a batch reorder, another library's hook) simply drops its
buffer. Writes go only past a buffer's live length, so a view another cache holds never changes.
`kv_bytes()` counts the live entries; `kv_capacity_bytes()` counts the buffers.
`CompressedCache(in_place=False)` restores the old `torch.cat` path (benchmarks compare the two).

Two lengths are kept apart: `get_seq_length()` reports the tokens *seen* (transformers derives
position ids from it, and new tokens must keep their original positions), while the physical length
(`seq_lengths()`, `get_mask_sizes`) is what is stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, DynamicLayer

from centroidkv.budget import (
    DEFAULT_BUDGET_UNIT,
    RECORD_BYTES,
    budget_entries,
    check_budget,
    check_budget_unit,
    fit_protected,
    solve_entries,
)
from centroidkv.heads import favoured_len
from centroidkv.kv import LayerKV, LayerStats
from centroidkv.methods import Method, get_method
from centroidkv.needs import RECORDERS, Need, gather_needs
from centroidkv.quantization import PackedCodes, StorageFormat, concat, dequantize, quantize, value_group

# The slots whose entries a storage precision converts (`centroidkv.quantization`), and the axis of
# their integer codes: keys per channel, values per token (KIVI).
STORED_SLOTS = {"keys": "channel", "values": "token", "whole_keys": "channel", "whole_values": "token"}

# How to fix a fork whose source cache did not record what the method needs (the end of that error).
FORK_NEEDS_FIX = (
    "record it in the source: pass needs=needs_of([...the methods you will fork to]) to "
    "centroidkv.decoding.prefill, or needs=... to the source CompressedCache"
)


class CompressedLayer(DynamicLayer):
    """One layer's entries and records (layout in the module docstring)."""

    compresses = True  # False for a hybrid model's window layers (`centroidkv.window_layer`)

    def __init__(self, owner: CompressedCache, layer_idx: int):
        super().__init__()
        # A weak reference: a strong one would make cache <-> layer a reference cycle, and every
        # dropped cache (one per fork) would hold its tensors until Python's cycle collector runs.
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.log_degree: Tensor | None = None
        self.extras: dict[str, Tensor] = {}  # entry records [B, H_c, T] (centroidkv.needs)
        self.windows: dict[str, Tensor] = {}  # window records, e.g. "queries" [B, H_q, w, D]
        # Heads kept whole (set at the first compression when the method keeps some, else None):
        self.compressed_heads: Tensor | None = None  # KV head ids held by keys / values, [H_c]
        self.whole_heads: Tensor | None = None  # KV head ids held by whole_keys / whole_values, [H_o]
        self.whole_keys: Tensor | None = None  # [B, H_o, n_seen, D], never compressed
        self.whole_values: Tensor | None = None
        # heads=budget (set at the first compression when the policy lists heads for this layer):
        self.favoured_heads: Tensor | None = None  # KV head ids held by `favoured`, [H_f]
        self.favoured: CompressedLayer | None = None  # their own layer, compressed to boost x B
        self.is_favoured = False  # this layer is another layer's `favoured` group
        self.scaling: float = 1.0
        self.query_group = 1  # query heads per KV head (set by the first attention call)
        self.n_seen = 0  # tokens this layer has seen (positions), not what it stores
        self.prompt_len: int | None = None  # length of the first update (the prefill)
        self.n_compressions = 0
        self.protected_used: tuple[int, int] | None = None  # (n_sink, n_recent) of the last compression
        # attribute or "extras.<name>" -> (buffer, the live view of it last stored in that attribute)
        self._buffers: dict[str, tuple[Tensor, Tensor]] = {}
        # Integer storage (`centroidkv.quantization`): slot -> the codes of its oldest entries; the slot's
        # attribute then holds only the newest entries (the full-precision residual) after them.
        self.packed: dict[str, PackedCodes] = {}

    @property
    def owner(self) -> CompressedCache:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("this cache layer outlived its CompressedCache")
        return owner

    @property
    def attention_sum(self) -> Tensor | None:
        return self.extras.get("attention_sum")

    @property
    def queries(self) -> Tensor | None:
        return self.windows.get("queries")

    # --- transformers' layer interface -------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None):
        """Store the new tokens; return this layer's keys and values for the attention (dequantized
        when the storage is not the model's dtype)."""
        self.add(key_states, value_states)
        return self.read("keys"), self.read("values")

    def add(self, key_states: Tensor, value_states: Tensor) -> None:
        """Store the new tokens' keys and values [B, H, q, D] (and their records)."""
        if self.owner.n_layers is None:
            raise RuntimeError(
                "CompressedCache needs a model prepared by centroidkv: load it with centroidkv.load_model, "
                "or call centroidkv.prepare_model(model) once after loading it yourself (its attention adds "
                "log-degrees and triggers compression)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.whole_heads is not None:  # heads kept whole grow in their own tensors
            self._append("whole_keys", key_states[:, self.whole_heads])
            self._append("whole_values", value_states[:, self.whole_heads])
        if self.favoured is not None:  # favoured heads grow in their own layer
            self.favoured.add(key_states[:, self.favoured_heads], value_states[:, self.favoured_heads])
        if self.compressed_heads is not None:
            key_states, value_states = (
                key_states[:, self.compressed_heads],
                value_states[:, self.compressed_heads],
            )
        batch, heads, new_tokens = key_states.shape[:3]
        if self.length == 0:  # the first tokens: keep the projections as they are, no copy
            self.keys, self.values = key_states, value_states
        else:
            self._append("keys", key_states)
            self._append("values", value_states)
        if self.owner.storage.precision != "model":
            self.settle()
        if self.log_degree is not None:
            self._append("log_degree", key_states.new_zeros(batch, heads, new_tokens, dtype=torch.float32))
        for name in self.owner.entry_needs:
            new = RECORDERS[name].initial(self.n_seen, (batch, heads, new_tokens), key_states.device)
            if name in self.extras:
                self._append(f"extras.{name}", new)
            else:
                self.extras[name] = new
        self.n_seen += new_tokens
        if self.prompt_len is None:
            self.prompt_len = new_tokens
            self.check_planned_room()

    # --- storage precision (centroidkv.quantization) ---------------------------------------------------
    def read(self, slot: str) -> Tensor:
        """The entries of `slot` ("keys", "values", "whole_keys", "whole_values") in the model's dtype:
        the stored tensor itself at the model's precision, else a transient dequantized copy."""
        live = self._get(slot)
        packed = self.packed.get(slot)
        if packed is None:
            return live if live.dtype == self.dtype else live.to(self.dtype)
        return torch.cat([dequantize(packed, self.dtype), live.to(self.dtype)], dim=2)

    def slot_length(self, slot: str) -> int:
        """Entries stored in `slot` (codes and residual)."""
        live = self._get(slot)
        packed = self.packed.get(slot)
        return (0 if live is None or live.dim() < 4 else live.shape[2]) + (
            0 if packed is None else packed.length
        )

    def settle(self) -> None:
        """Bring every stored slot to the cache's storage format: the float dtype it names, or, for
        integer codes, every whole group beyond the residual window quantized (KIVI's order: a token
        leaves the full-precision residual a group at a time)."""
        storage = self.owner.storage
        for slot, axis in STORED_SLOTS.items():
            live = self._get(slot)
            if live is None or live.dim() < 4:
                continue
            packed = self.packed.get(slot)
            group = storage.group if axis == "channel" else value_group(storage.group, live.shape[-1])
            if packed is not None and (packed.bits != storage.bits or packed.group != group):
                live, packed = self.read(slot), None  # codes of another format: start again from floats
                self.packed.pop(slot)
                self._set(slot, live)
            if not storage.integer:
                dtype = storage.float_dtype or self.dtype
                if live.dtype != dtype:
                    self._set(slot, live.to(dtype))
                    self._buffers.pop(slot, None)
                continue
            if live.dtype != self.dtype:
                live = live.to(self.dtype)
                self._set(slot, live)
            moved = storage.quantized_length(live.shape[2])
            if moved:
                self.packed[slot] = concat(
                    packed, quantize(live[:, :, :moved], storage.bits, storage.group, axis)
                )
                self._keep_residual(slot, live[:, :, moved:])
        if self.favoured is not None:
            self.favoured.settle()

    def _keep_residual(self, slot: str, residual: Tensor) -> None:
        """Store `residual` (a view into a larger tensor) in a buffer of its own with room for the
        tokens decoded until its next group is quantized."""
        if not self.owner.in_place:
            self._set(slot, residual.clone())
            self._buffers.pop(slot, None)
            return
        length = residual.shape[2]
        buffer = residual.new_empty(
            *residual.shape[:2], self._capacity(slot, length, first=False), *residual.shape[3:]
        )
        buffer[:, :, :length] = residual
        self._store(slot, buffer, length)

    def check_planned_room(self) -> None:
        """Raise now (one line) when the generation this cache was planned for (the prompt plus
        `max_new_tokens`) will need a compression whose budget holds no entry at all,
        instead of failing at that compression, possibly many tokens later."""
        method = self.owner.method
        if not method.compresses or not self.owner.compression_enabled:
            return
        budget, planned = self.budget_len, self.prompt_len + max(0, self.owner.max_new_tokens - 1)
        if self.prompt_len > budget or planned > budget + method.compress_interval - 1:
            self.check_protected_fit()

    # --- in-place buffers (module docstring) -----------------------------------------------------
    def _get(self, slot: str) -> Tensor | None:
        if slot.startswith("extras."):
            return self.extras.get(slot.removeprefix("extras."))
        return getattr(self, slot)

    def _set(self, slot: str, live: Tensor) -> None:
        if slot.startswith("extras."):
            self.extras[slot.removeprefix("extras.")] = live
        else:
            setattr(self, slot, live)

    def _append(self, slot: str, new: Tensor) -> None:
        """Append `new` along dim 2 to the tensor in `slot`: in place when its buffer has room."""
        live = self._get(slot)
        if not self.owner.in_place:
            self._set(slot, torch.cat([live, new], dim=2))
            return
        length, needed = live.shape[2], live.shape[2] + new.shape[2]
        buffer, view = self._buffers.get(slot, (None, None))
        if view is not live or buffer.shape[2] < needed:  # no buffer, a replaced tensor, or full
            capacity = self._capacity(slot, needed, first=view is not live)
            buffer = live.new_empty(*live.shape[:2], capacity, *live.shape[3:])
            buffer[:, :, :length] = live
        buffer[:, :, length:needed] = new
        self._store(slot, buffer, needed)

    def _store(self, slot: str, buffer: Tensor, length: int) -> None:
        live = buffer[:, :, :length]
        self._buffers[slot] = (buffer, live)
        self._set(slot, live)

    def _drop_stale_buffer(self, slot: str) -> None:
        """Forget the buffer of `slot` once the slot holds another tensor (a record recomputed out of
        place): the buffer would otherwise stay allocated, uncounted by `kv_capacity_bytes`."""
        held = self._buffers.get(slot)
        if held is not None and held[1] is not self._get(slot):
            del self._buffers[slot]

    def _capacity(self, slot: str, needed: int, first: bool) -> int:
        """Entries to allocate for `slot` when `needed` no longer fit (headroom rules: module docstring).

        `first`: the slot has no buffer of its own yet (e.g. the first step after a fork)."""
        method, storage = self.owner.method, self.owner.storage
        if storage.integer and slot in STORED_SLOTS:
            # the residual: it holds residual .. residual + group - 1 entries between quantizations
            return max(needed, storage.residual + storage.group)
        if method.compresses and self.prompt_len is not None and not slot.startswith("whole_"):
            # compressed entries: room for the g tokens decoded before the next compression
            return max(self.budget_len, needed) + method.compress_interval
        if first and self.owner.max_new_tokens:
            # the generation the cache was planned for: of max_new_tokens generated tokens all but
            # the last are fed back, so max_new_tokens - 1 more after this write
            return needed + self.owner.max_new_tokens - 1
        return 2 * needed

    def capacity_bytes(self) -> int:
        """Bytes of the buffers behind this layer's stored tensors (live entries plus headroom)."""
        total = self.favoured.capacity_bytes() if self.favoured is not None else 0
        for tensor in self._own_tensors():
            backing = next((buf for buf, view in self._buffers.values() if view is tensor), tensor)
            total += backing.numel() * backing.element_size()
        records = [*self.windows.values(), self.compressed_heads, self.whole_heads, self.favoured_heads]
        return total + sum(t.numel() * t.element_size() for t in records if t is not None)

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_mask_sizes(self, cache_position: Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a compressed cache cannot be cropped (positions no longer map to entries)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn) -> None:
        for attr in ("keys", "values", "log_degree", "whole_keys", "whole_values"):
            tensor = getattr(self, attr)
            if tensor is not None and tensor.numel() > 0:
                setattr(self, attr, fn(tensor))
        self.packed = {slot: packed.map(fn) for slot, packed in self.packed.items()}
        for records in (self.extras, self.windows):
            for name, tensor in records.items():
                records[name] = fn(tensor)
        if self.favoured is not None:
            self.favoured._map_batch(fn)

    # --- compression -----------------------------------------------------------------------------
    @property
    def tracks_attention(self) -> bool:
        """Whether the attention function must compute the attention each entry receives."""
        return any(RECORDERS[name].uses_received for name in self.owner.entry_needs)

    @property
    def length(self) -> int:
        """Entries per compressed head (the heads kept whole hold `n_seen`)."""
        return self.slot_length("keys")

    def head_lengths(self) -> list[int]:
        """Entries per KV head, in head order."""
        if self.compressed_heads is None:
            return [self.length] * (0 if self.keys is None or self.keys.dim() < 4 else self.keys.shape[1])
        other = self.whole_heads if self.whole_heads is not None else self.favoured_heads
        other_length = (
            self.slot_length("whole_keys") if self.whole_heads is not None else self.favoured.length
        )
        lengths = [0] * (len(self.compressed_heads) + len(other))
        for head in self.compressed_heads.tolist():
            lengths[head] = self.length
        for head in other.tolist():
            lengths[head] = other_length
        return lengths

    def stored_tensors(self) -> list[Tensor]:
        """Everything this layer stores for its method: entries, degrees, entry records, whole heads,
        window records (e.g. SnapKV's query window), the ids of its head groups, and the favoured
        heads' layer."""
        favoured = self.favoured.stored_tensors() if self.favoured is not None else []
        heads = [self.compressed_heads, self.whole_heads, self.favoured_heads]
        groups = [ids for ids in heads if ids is not None]
        return self._own_tensors() + list(self.windows.values()) + groups + favoured

    def _own_tensors(self) -> list[Tensor]:
        parts = [
            self.keys,
            self.values,
            self.log_degree,
            *self.extras.values(),
            self.whole_keys,
            self.whole_values,
            *(t for packed in self.packed.values() for t in packed.tensors()),
        ]
        return [t for t in parts if t is not None]

    @property
    def budget_len(self) -> int | None:
        """B for this layer, known once the prompt length is."""
        if self.prompt_len is None:
            return None
        return self.owner.layer_budget_len(self)

    def degrees_or_zeros(self) -> Tensor:
        if self.log_degree is not None:
            return self.log_degree
        return self.keys.new_zeros(*self.keys.shape[:2], self.length, dtype=torch.float32)

    def after_attention(self, query: Tensor, scaling: float, received: Tensor | None = None) -> None:
        """Called by the attention function once this layer's attention output is computed.

        `received` ([B, H_c, T]): the attention each compressed-head entry got from `query`, which
        the attention function computes alongside its output when the cache tracks attention.
        """
        self.scaling = scaling
        if (
            self.compressed_heads is None
            and self.keys is not None
            and self.keys.dim() == 4
            and self.keys.shape[1]
        ):
            self.query_group = query.shape[1] // self.keys.shape[1]
        for name, window in self.owner.window_needs.items():
            # a copy: a slice would keep the whole tensor it was cut from (the prompt's queries) alive
            self.windows[name] = (
                RECORDERS[name].after_attention(self.windows.get(name), query, None)[:, :, -window:].clone()
            )
        no_entries = self.keys is not None and self.keys.dim() == 4 and self.keys.shape[1] == 0
        for name in [] if no_entries else self.owner.entry_needs:  # every head listed: nothing to record
            if RECORDERS[name].uses_received and received is None:
                raise RuntimeError(f"this cache records {name}: the attention function must pass `received`")
            self.extras[name] = RECORDERS[name].after_attention(self.extras[name], query, received)
            self._drop_stale_buffer(f"extras.{name}")
        if self.needs_compression():
            self.compress()

    def needs_compression(self) -> bool:
        if not (self.owner.compression_enabled and self.owner.method.compresses) or self.length == 0:
            return False
        if self.keys.shape[1] == 0:  # every head is kept whole
            return False
        limit = self.budget_len
        if self.n_seen > self.prompt_len:  # decoding: let g tokens accumulate before re-compressing
            limit += self.owner.method.compress_interval - 1
        return self.length > limit

    def split_heads(self, listed: list[int], policy: str) -> None:
        """Move the KV heads `listed` into their own group: tensors kept whole from now on (policy
        "whole") or a layer of their own with a larger budget ("budget")."""
        n_heads = self.keys.shape[1]
        if any(not 0 <= head < n_heads for head in listed):
            raise ValueError(f"layer {self.layer_idx}: listed heads {listed} outside 0..{n_heads - 1}")
        device = self.keys.device
        other = torch.tensor(sorted(listed), dtype=torch.long, device=device)
        self.compressed_heads = torch.tensor(
            [h for h in range(n_heads) if h not in listed], dtype=torch.long, device=device
        )
        if policy == "whole":
            self.whole_heads = other
            self.whole_keys, self.whole_values = self.keys[:, other], self.values[:, other]
            for slot in ("keys", "values"):
                if slot in self.packed:
                    self.packed[f"whole_{slot}"] = self.packed[slot].heads(other)
        else:
            self.favoured_heads, self.favoured = other, self._group_layer(other)
        self.keys, self.values = self.keys[:, self.compressed_heads], self.values[:, self.compressed_heads]
        for slot in ("keys", "values"):
            if slot in self.packed:
                self.packed[slot] = self.packed[slot].heads(self.compressed_heads)
        if self.log_degree is not None:
            self.log_degree = self.log_degree[:, self.compressed_heads]
        self.extras = {name: record[:, self.compressed_heads] for name, record in self.extras.items()}
        self.windows = {
            name: query_rows(window, self.compressed_heads, n_heads) for name, window in self.windows.items()
        }

    def _group_layer(self, heads: Tensor) -> CompressedLayer:
        """A layer of its own for the KV heads `heads` of this one (heads=budget), holding their
        entries, degrees, records and windows as they are now."""
        group = CompressedLayer(self.owner, self.layer_idx)
        group.is_favoured = True
        group.keys, group.values = self.keys[:, heads], self.values[:, heads]
        group.packed = {
            slot: self.packed[slot].heads(heads) for slot in ("keys", "values") if slot in self.packed
        }
        group.log_degree = None if self.log_degree is None else self.log_degree[:, heads]
        group.extras = {name: record[:, heads] for name, record in self.extras.items()}
        n_heads = self.keys.shape[1]
        group.windows = {name: query_rows(window, heads, n_heads) for name, window in self.windows.items()}
        for attr in ("scaling", "query_group", "n_seen", "prompt_len", "is_initialized", "dtype", "device"):
            setattr(group, attr, getattr(self, attr))
        return group

    def compress(self) -> None:
        """Shrink this layer to its budget, leaving sinks, the recent window and whole heads untouched."""
        self.owner.plan_budget(self)  # in bytes: what the heads kept whole hold now
        method, budget = self.owner.method, self.budget_len
        listed = self.owner.heads_listed().get(self.layer_idx)
        if listed and self.compressed_heads is None and not self.is_favoured:
            self.split_heads(listed, method.heads)
            if self.favoured is not None and self.favoured.length > self.favoured.budget_len:
                self.favoured.compress()
        length = self.length
        if length <= budget or self.keys.shape[1] == 0:
            return
        n_sink, n_recent = self.protected_windows()  # shrunk to the budget for a short prompt
        self.protected_used = (n_sink, n_recent)
        middle = slice(n_sink, length - n_recent)
        log_degree = self.degrees_or_zeros()
        # A merge or eviction works on the entries in the model's dtype (dequantized when the storage
        # is not); the result is stored in the storage format again (`settle`, below).
        keys, values = self.read("keys"), self.read("values")
        segment = LayerKV(
            keys[:, :, middle],
            values[:, :, middle],
            log_degree[:, :, middle],
            {name: record[:, :, middle] for name, record in self.extras.items()},
        )
        stats = LayerStats(
            layer_idx=self.layer_idx,
            n_layers=self.owner.n_layers,
            scaling=self.scaling,
            windows=self.windows,
            keys=keys,
            log_degree=log_degree,
            middle=middle,
            rotary=self.owner.rotary[self.layer_idx] if self.owner.rotary else None,
        )
        target = budget - n_sink - n_recent
        kept = method.compress(segment, target, stats)
        if kept.length != target:
            raise RuntimeError(f"{method.name} returned {kept.length} tokens instead of {target}")

        # The result goes into buffers with room for the g tokens decoded before the next compression.
        capacity = self._capacity("keys", budget, first=True) if self.owner.in_place else budget

        def splice(slot: str, full: Tensor, new_middle: Tensor) -> None:
            buffer = full.new_empty(*full.shape[:2], capacity, *full.shape[3:])
            buffer[:, :, :n_sink] = full[:, :, :n_sink]
            buffer[:, :, n_sink : budget - n_recent] = new_middle
            buffer[:, :, budget - n_recent : budget] = full[:, :, length - n_recent :]
            self._store(slot, buffer, budget)

        self.packed.pop("keys", None)
        self.packed.pop("values", None)
        splice("keys", keys, kept.keys)
        splice("values", values, kept.values)
        if method.merges or self.log_degree is not None:
            splice("log_degree", log_degree, kept.log_degree)
        for name, record in list(self.extras.items()):
            splice(f"extras.{name}", record, kept.extras[name])
        self.n_compressions += 1
        if self.owner.storage.precision != "model":
            self.settle()

    def protected_windows(self) -> tuple[int, int]:
        """(n_sink, n_recent) this layer's compressions keep: the method's, shrunk to the budget when it
        cannot hold them (`centroidkv.budget.fit_protected`: the recent window first, then the sinks)."""
        method = self.owner.method
        return fit_protected(self.budget_len, method.n_sink, method.n_recent, f"{method.name} at this budget")

    def check_protected_fit(self) -> None:
        """Raise (one line) when this layer's budget holds no entry at all; a budget below the protected
        windows shrinks them instead (`protected_windows`)."""
        self.protected_windows()

    def fork(self, owner: CompressedCache) -> CompressedLayer:
        """A layer for another cache that shares this one's tensors (never modified in place), with
        only the records `owner` asks for."""
        twin = owner.new_layer(self.layer_idx)
        for attr in (
            "keys",
            "values",
            "log_degree",
            "compressed_heads",
            "whole_heads",
            "whole_keys",
            "whole_values",
            "favoured_heads",
            "is_favoured",
            "scaling",
            "query_group",
            "n_seen",
            "prompt_len",
            "n_compressions",  # the entries' history travels with them (a fork of a compressed cache)
            "protected_used",
        ):
            setattr(twin, attr, getattr(self, attr))
        twin.packed = dict(self.packed)  # codes are never modified in place: shared until replaced
        if self.favoured is not None:
            twin.favoured = self.favoured.fork(owner)
        twin.is_initialized, twin.dtype, twin.device = self.is_initialized, self.dtype, self.device
        for name in owner.entry_needs:
            if name in self.extras:
                twin.extras[name] = self.extras[name]
            elif RECORDERS[name].rebuildable and self.length == self.n_seen and self.compressed_heads is None:
                shape = (*self.keys.shape[:2], self.length)
                twin.extras[name] = RECORDERS[name].initial(0, shape, self.keys.device)
            else:
                raise ValueError(
                    f"{owner.method.name} needs {name!r}, which the source cache did not record; {FORK_NEEDS_FIX}"
                )
        for name, window in owner.window_needs.items():
            if name not in self.windows or self.windows[name].shape[2] < window:
                raise ValueError(
                    f"{owner.method.name} needs a {name!r} window of {window}, which the source cache did not keep; "
                    + FORK_NEEDS_FIX
                )
            # the fork's own copy: a view would keep the source's whole window (and, for the shared
            # prefill, its storage) alive for as long as the fork lives (kv_bytes counts it)
            twin.windows[name] = self.windows[name][:, :, -window:].clone()
        return twin


def query_rows(window: Tensor, kv_heads: Tensor, n_kv_heads: int) -> Tensor:
    """The rows of a window record [B, H_q, w, ...] that belong to the query heads of `kv_heads` (of
    `n_kv_heads`; KV head h's query heads are rows h * group .. h * group + group - 1)."""
    return window.unflatten(1, (n_kv_heads, -1))[:, kv_heads].flatten(1, 2)


def causal_allowed(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """[q, kv] bool: query i (the i-th of the last q tokens) may see keys 0 .. kv_len - q_len + i."""
    query_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= query_pos


class CompressedCache(Cache):
    """A transformers `Cache` whose layers shrink to a budget with a compression `Method`.

    Args:
      method: a `Method` instance or a registered name (then built with its defaults).
      budget: R, the fraction of (prompt + max_new_tokens) tokens each layer may keep, in (0, 1].
      max_new_tokens: Gamma, the generation length the budget accounts for.
      needs: records to keep besides the method's own (`centroidkv.needs`), so that `fork` can serve
        methods that need them (a shared prefill records the needs of every method of a job).
      in_place: decode into preallocated buffers (module docstring); False concatenates every step.
      budget_unit: "bytes" (everything stored is R times a full cache of n + Gamma tokens) or
        "entries" (B = R * (n + Gamma) entries per compressed head); `centroidkv.budget`.
    """

    # The layer of a hybrid model's window layers: `centroidkv.window_layer.WindowLayer` registers itself
    # here (it subclasses CompressedLayer, so this module cannot import it).
    window_layer_class: type[CompressedLayer] | None = None

    def __init__(
        self,
        method: Method | str = "centroidkv",
        budget: float = 0.25,
        max_new_tokens: int = 0,
        needs: Iterable[Need] = (),
        in_place: bool = True,
        budget_unit: str = DEFAULT_BUDGET_UNIT,
    ):
        check_budget_unit(budget_unit)
        if isinstance(method, str):
            method = get_method(method)
        check_budget(budget)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        super().__init__(layers=[])
        self.method = method
        self.budget = float(budget)
        self.max_new_tokens = max_new_tokens
        self.n_layers: int | None = None  # set by the attention hook (prepare_model)
        # each layer's rotary table (an object with `inv_freq`), set by the same hook; None: no rotary
        self.rotary: list | None = None
        self.sliding_windows: dict[int, int] = {}  # {layer: W} of a hybrid model, set by the same hook
        self.query_group: int | None = None  # query heads per KV head, set by the same hook
        self.model_ref: Callable[[], nn.Module | None] = lambda: None  # weak reference, same hook
        self.compression_enabled = True
        self.in_place = in_place
        self.budget_unit = budget_unit
        self.storage: StorageFormat = method.storage  # how keys and values are stored (quantization)
        self._byte_plan: tuple[tuple[int, int], list[int]] | None = None  # (key, entries per layer)
        recorded = gather_needs([*method.needs(), *needs])
        self.entry_needs = [name for name in recorded if not RECORDERS[name].window]
        self.window_needs = {name: size for name, size in recorded.items() if RECORDERS[name].window}
        self._listed: dict[int, list[int]] | None = None

    def heads_listed(self) -> dict[int, list[int]]:
        """The KV heads per layer that the method's head policy lists, asked once (needs the model:
        `prepare_model`); a window layer's heads are never listed (it is never compressed)."""
        if self._listed is None:
            listed = self.method.listed_heads(self.model_ref())
            self._listed = {
                layer: heads for layer, heads in listed.items() if layer not in self.sliding_windows
            }
        return self._listed

    def heads_kept_whole(self) -> dict[int, list[int]]:
        """The listed heads when they are kept whole (heads=whole), else none."""
        return self.heads_listed() if self.method.heads == "whole" else {}

    # --- the budget (module docstring; centroidkv.budget) -------------------------------------------
    def layer_budget_len(self, layer: CompressedLayer) -> int:
        """B for `layer`: entries per compressed head, in the cache's budget unit (boost x B for the
        favoured heads' layer under heads=budget)."""
        if self.budget_unit == "entries" or not self.method.compresses:
            entries = budget_entries(self.budget, layer.prompt_len, self.max_new_tokens)
            budget = self.method.layer_budget(entries, layer.layer_idx, self.n_layers)
        else:
            if self._byte_plan is None:
                self.plan_budget(layer)
            budget = self._byte_plan[1][layer.layer_idx]
        if layer.is_favoured:
            return favoured_len(budget, self.method.heads_boost, layer.prompt_len + self.max_new_tokens)
        return budget

    def plan_budget(self, layer: CompressedLayer) -> None:
        """In bytes, solve every layer's B for what is stored when `layer` compresses. Listed heads
        (kept whole, or favoured below their own budget) grow while decoding, so the plan is solved
        again at a compression that sees more tokens; between compressions it holds (the cache then
        grows to B + g, as with entries)."""
        if self.budget_unit != "bytes" or not self.method.compresses:
            return
        key = (layer.prompt_len, layer.n_seen if self.heads_listed() else 0)
        if self._byte_plan is None or self._byte_plan[0] != key:
            self._byte_plan = (key, self._solve_byte_plan(layer))

    def _solve_byte_plan(self, layer: CompressedLayer) -> list[int]:
        """Entries per layer such that everything stored right after a compression is at most R times
        the bytes of a full cache of n + Gamma tokens, and one more entry per layer would exceed it.
        Layers are alike (heads, head size, dtype), so `layer` describes them all."""
        batch, _, _, head_dim = layer.keys.shape
        n_heads = len(self.layers[layer.layer_idx].head_lengths())  # every KV head of a layer
        entry_bytes = 2 * head_dim * layer.dtype.itemsize  # a key and a value of one head, model dtype
        n_records = len(self.entry_needs) + (1 if self.method.merges else 0)  # + the log-degree
        storage = self.storage
        quantized_entry = storage.entry_bytes(head_dim, layer.dtype.itemsize, quantized=True)
        stored_entry = storage.entry_bytes(head_dim, layer.dtype.itemsize, quantized=False)

        def head_bytes(length: int) -> float:
            """Keys, values (codes and residual, in the storage format) and records of one head."""
            codes = storage.quantized_length(length)
            return (
                codes * quantized_entry + (length - codes) * stored_entry + RECORD_BYTES * n_records * length
            )

        listed, whole = self.heads_listed(), self.heads_kept_whole()
        favoured = {} if whole else listed
        n_layers, windows = self.n_layers, self.sliding_windows
        compressed_heads = [
            0 if index in windows else n_heads - len(listed.get(index, ())) for index in range(n_layers)
        ]
        favoured_heads = [len(favoured.get(index, ())) for index in range(n_layers)]
        whole_bytes = (
            batch
            * sum(map(len, whole.values()))
            * (head_bytes(layer.n_seen) - RECORD_BYTES * n_records * layer.n_seen)
        )
        # Stored whatever B is: the window records (the query heads of every KV head not kept whole)
        # and the ids of the head groups of the layers whose heads are split (int64).
        # (the model's query group: a plan solved before the first attention call knows it too)
        query_group = self.query_group or layer.query_group
        window_rows = sum(
            query_group * (n_heads - len(whole.get(index, ())))
            for index in range(n_layers)
            if index not in windows
        )
        window_len = sum(self.window_needs.values())
        fixed_bytes = batch * window_rows * window_len * head_dim * layer.dtype.itemsize
        # a hybrid model's window layers: their last W - 1 entries, in the model's dtype
        fixed_bytes += (
            batch * n_heads * entry_bytes * sum(self.layer_entries(i, layer.n_seen) for i in windows)
        )
        fixed_bytes += (
            n_heads * torch.empty((), dtype=torch.long).element_size() * sum(map(bool, listed.values()))
        )
        full_len = layer.prompt_len + self.max_new_tokens
        reference_entries = sum(self.layer_entries(index, full_len) for index in range(n_layers))
        target = int(self.budget * batch * n_heads * entry_bytes * reference_entries)
        boost = self.method.heads_boost

        def stored_bytes(total: int) -> int:
            per_layer = [self.method.layer_budget(total, index, n_layers) for index in range(n_layers)]
            heads_bytes = sum(
                heads * head_bytes(length) for heads, length in zip(compressed_heads, per_layer, strict=True)
            )
            heads_bytes += sum(  # a favoured head stores what it has seen, at most its budget
                heads * head_bytes(min(layer.n_seen, favoured_len(length, boost, full_len)))
                for heads, length in zip(favoured_heads, per_layer, strict=True)
            )
            return fixed_bytes + whole_bytes + batch * heads_bytes

        try:
            total = solve_entries(stored_bytes, target, upper=full_len)
        except ValueError as error:
            raise ValueError(f"{self.method.name} at budget {self.budget:g} in bytes: {error}") from None
        return [self.method.layer_budget(total, index, n_layers) for index in range(n_layers)]

    def take_model_from(self, source: CompressedCache) -> None:
        """What the attention hook tells a cache about its model (`centroidkv.attention`), from `source`."""
        self.n_layers, self.rotary, self.model_ref = source.n_layers, source.rotary, source.model_ref
        self.sliding_windows, self.query_group = source.sliding_windows, source.query_group

    def layer(self, layer_idx: int) -> CompressedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(self.new_layer(len(self.layers)))
        return self.layers[layer_idx]

    def new_layer(self, layer_idx: int) -> CompressedLayer:
        """An empty layer: a window layer of a hybrid model (`centroidkv.window_layer`), else compressed."""
        if layer_idx in self.sliding_windows:
            return self.window_layer_class(self, layer_idx, self.sliding_windows[layer_idx])
        return CompressedLayer(self, layer_idx)

    def layer_entries(self, layer_idx: int, length: int) -> int:
        """Entries per head a full cache holds in `layer_idx` after `length` tokens: all of them, or the
        last W - 1 in a window layer (transformers' own sliding-window cache)."""
        window = self.sliding_windows.get(layer_idx)
        return length if window is None else min(length, window - 1)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs: dict | None = None
    ):
        return self.layer(layer_idx).update(key_states, value_states, cache_kwargs)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Feed tokens without compressing (e.g. the question in the context-only protocol)."""
        previous, self.compression_enabled = self.compression_enabled, False
        try:
            yield
        finally:
            self.compression_enabled = previous

    def compress_now(self) -> None:
        """Compress every layer that is over its budget (used after `fork`)."""
        for layer in self.layers:
            if layer.needs_compression():
                layer.compress()

    def fork(
        self,
        method: Method | str,
        budget: float,
        max_new_tokens: int | None = None,
        needs: Iterable[Need] = (),
        budget_unit: str | None = None,
    ) -> CompressedCache:
        """A new cache over the same entries with another method or budget, already compressed
        (`budget_unit` None: this cache's).

        This is how one prefill serves many (method, budget) runs: tensors are shared, not copied.
        Compression replaces tensors, and decoding writes only past the live length of buffers the
        writing cache owns (a fork owns none until its first write), so a shared view never changes. The source
        cache must have recorded what the new method needs, and `needs` (records to carry along,
        e.g. for a diagnostic).
        """
        twin = CompressedCache(
            method,
            budget,
            self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            needs,
            in_place=self.in_place,
            budget_unit=self.budget_unit if budget_unit is None else budget_unit,
        )
        twin.take_model_from(self)
        twin.layers = [layer.fork(twin) for layer in self.layers]
        twin.compress_now()  # on the source's entries as they are, then in the fork's own format
        if twin.storage.precision != "model" or self.storage.precision != "model":
            for layer in twin.layers:
                if layer.is_initialized:
                    layer.settle()
        return twin

    def check_room(self, n_new_tokens: int) -> None:
        """Raise now, not mid-generation, when `n_new_tokens` more decoded tokens will need a compression
        whose budget holds no entry at all (known as soon as the prompt is in)."""
        for layer in self.layers:
            if (
                not (self.method.compresses and layer.compresses)
                or layer.length == 0
                or layer.keys.shape[1] == 0
            ):
                continue  # as in needs_compression: nothing to compress here
            if layer.length + n_new_tokens > layer.budget_len + self.method.compress_interval - 1:
                layer.check_protected_fit()

    def kv_bytes(self) -> int:
        """Bytes of everything the cache stores: keys, values, log-degrees, the method's entry records
        (e.g. positions) and the heads kept whole."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.stored_tensors())

    def kv_capacity_bytes(self) -> int:
        """Bytes allocated for what `kv_bytes()` counts: the live entries plus the buffers' headroom."""
        return sum(layer.capacity_bytes() for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes the keys and values of every token seen would take in a full cache of the same dtype."""
        total = 0
        for layer in self.layers:
            if layer.keys is not None and layer.keys.dim() == 4:
                batch, _, _, head_dim = layer.keys.shape
                n_heads = len(layer.head_lengths())
                entries = self.layer_entries(layer.layer_idx, layer.n_seen)
                total += 2 * batch * n_heads * entries * head_dim * layer.dtype.itemsize
        return total

    def reference_bytes(self) -> int:
        """Bytes of the budget's reference: a full cache (keys and values, same dtype) of the prompt
        plus `max_new_tokens` tokens; R times this is what a byte budget stores."""
        total = 0
        for layer in self.layers:
            if layer.prompt_len is not None and layer.keys is not None and layer.keys.dim() == 4:
                batch, _, _, head_dim = layer.keys.shape
                full_len = self.layer_entries(layer.layer_idx, layer.prompt_len + self.max_new_tokens)
                total += 2 * batch * len(layer.head_lengths()) * full_len * head_dim * layer.dtype.itemsize
        return total

    def budget_ratio(self) -> float:
        """`kv_bytes()` over `reference_bytes()`: R, measured (right after a compression in bytes)."""
        reference = self.reference_bytes()
        return self.kv_bytes() / reference if reference else float("nan")

    def allocated_ratio(self) -> float:
        """`kv_capacity_bytes()` over `reference_bytes()`: the memory really allocated (the buffers'
        decode headroom included) as a fraction of the budget's reference (`budget_ratio` counts the
        live entries only)."""
        reference = self.reference_bytes()
        return self.kv_capacity_bytes() / reference if reference else float("nan")

    def kv_ratio(self) -> float:
        """Effective KV ratio: `kv_bytes()` over a full cache's bytes (what memory the budget really buys)."""
        full = self.full_kv_bytes()
        return self.kv_bytes() / full if full else float("nan")

    def seq_lengths(self) -> list[int]:
        """Stored entries per layer of its compressed heads (the physical length the budget governs, not
        the tokens seen); heads kept whole hold every token seen (`head_lengths`)."""
        return [layer.length for layer in self.layers]

    def head_lengths(self) -> list[list[int]]:
        """Stored entries per (layer, KV head)."""
        return [layer.head_lengths() for layer in self.layers]

    @property
    def n_compressions(self) -> int:
        return max((layer.n_compressions for layer in self.layers), default=0)

    def protected_used(self) -> dict[str, int | None]:
        """The protected windows the compressions kept, fewest over layers: `n_sink_used` and
        `n_recent_used` are the method's n_sink and n_recent unless a prompt too short for them at the
        budget shrank them (`centroidkv.budget.fit_protected`); None before any compression."""
        used = [layer.protected_used for layer in self.layers if layer.protected_used is not None]
        if not used:
            return {"n_sink_used": None, "n_recent_used": None}
        return {"n_sink_used": min(s for s, _ in used), "n_recent_used": min(r for _, r in used)}
