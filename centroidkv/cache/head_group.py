"""One group of a layer's KV heads and everything the cache stores for it.

A method's head policy (`centroidkv.head_policy`) splits a layer's KV heads into groups at its first
compression; until then, and under `heads=none`, one group holds every head. A group's `role`
("compressed", "whole", "favoured", "window") is a label: its cache turns it into a `GroupPlan`
(`centroidkv.cache.group_plan`: the budget, the storage format, the records to keep) and its layer hands
that plan to every call of the group that needs settings. A group holds no reference to its layer or
cache: it stores tensors and applies the plan it is given.

Layout of a group (H_g its KV heads, H_q their query heads):
  keys, values   [B, H_g, T, D]   entries (in the storage format: `centroidkv.cache.quantization`)
  log_degree     [B, H_g, T]      float32 log of each entry's degree (None while all degrees are 1)
  extras[name]   [B, H_g, T]      entry records, aligned with the entries (`centroidkv.needs`)
  windows[name]  [B, H_q, w, ...] window records (e.g. the last w queries) of its query heads
  packed[slot]   the integer codes of a slot's oldest entries; the slot then holds the residual
  heads          [H_g] the layer's KV head ids it holds (None: every head, the layer is not split)
  dtype          the model's dtype, in which `read` returns keys and values

In-place decoding: every growing tensor is the live prefix `buffer[:, :, :length]` of a buffer with
headroom (`_capacity`), so a decode step copies one token instead of concatenating the whole cache.
A buffer is never shared: a fork starts from the source's live views and allocates its own buffer on
its first write, so a view another cache holds never changes. What a group has allocated
(`held_tensors`, `storage_bytes`) is every storage behind its tensors, whole: until a fork's first write, the
source's buffers (headroom included) that its views keep alive.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from centroidkv.cache.group_plan import GroupPlan
from centroidkv.cache.quantization import PackedCodes, concat, dequantize, quantize, value_group
from centroidkv.compression import compress_protected
from centroidkv.kv import LayerKV, LayerStats
from centroidkv.needs import RECORDERS

# The slots a storage precision converts, and the axis of their integer codes: keys per channel,
# values per token (KIVI).
STORED_SLOTS = {"keys": "channel", "values": "token"}


class HeadGroup:
    """Some KV heads of one layer and what is stored for them (module docstring)."""

    def __init__(self, role: str = "compressed", heads: Tensor | None = None):
        self.role = role  # which plan it is handed (`centroidkv.cache.planner.GroupPlanner.group_plan`)
        self.heads = heads
        self.dtype: torch.dtype | None = None  # the model's, set by the first tokens
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.log_degree: Tensor | None = None
        self.extras: dict[str, Tensor] = {}
        self.windows: dict[str, Tensor] = {}
        self.packed: dict[str, PackedCodes] = {}
        self.n_compressions = 0
        self.protected_used: tuple[int, int] | None = None  # (n_sink, n_recent) of its last compression
        # slot ("keys", "log_degree", "extras.<name>") -> (buffer, the live view of it last stored there)
        self._buffers: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def n_heads(self) -> int:
        return 0 if self.keys is None or self.keys.dim() < 4 else self.keys.shape[1]

    @property
    def length(self) -> int:
        """Entries per head (codes and residual)."""
        return self.slot_length("keys")

    def slot_length(self, slot: str) -> int:
        live, packed = self._get(slot), self.packed.get(slot)
        return (0 if live is None or live.dim() < 4 else live.shape[2]) + (
            0 if packed is None else packed.length
        )

    @property
    def tracks_attention(self) -> bool:
        """Whether the attention function must compute the attention each entry receives: one of the
        records it keeps is fed by it."""
        return any(RECORDERS[name].uses_received for name in self.extras)

    # --- storing tokens ---------------------------------------------------------------------------
    def add(self, key_states: Tensor, value_states: Tensor, n_seen: int, plan: GroupPlan) -> None:
        """Store the new tokens' keys and values [B, H_g, q, D] (tokens n_seen.. of the layer) and
        their records."""
        batch, heads, new_tokens = key_states.shape[:3]
        if self.length == 0:  # the first tokens: keep the projections as they are, no copy
            self.keys, self.values, self.dtype = key_states, value_states, key_states.dtype
        else:
            self._append("keys", key_states, plan)
            self._append("values", value_states, plan)
        if plan.storage.precision != "model":
            self.settle(plan)
        if not plan.keeps_records:
            return
        if self.log_degree is not None:
            new = key_states.new_zeros(batch, heads, new_tokens, dtype=torch.float32)
            self._append("log_degree", new, plan)
        for name in plan.entry_records:
            new = RECORDERS[name].initial(n_seen, (batch, heads, new_tokens), key_states.device)
            if name in self.extras:
                self._append(f"extras.{name}", new, plan)
            else:
                self.extras[name] = new

    def read(self, slot: str) -> Tensor:
        """The entries of `slot` ("keys" or "values") in the model's dtype: the stored tensor itself at
        the model's precision, else a transient dequantized copy."""
        live, packed, dtype = self._get(slot), self.packed.get(slot), self.dtype
        if packed is None:
            return live if live.dtype == dtype else live.to(dtype)
        return torch.cat([dequantize(packed, dtype), live.to(dtype)], dim=2)

    def settle(self, plan: GroupPlan) -> None:
        """Bring keys and values to the plan's storage format: the float dtype it names, or, for
        integer codes, every whole group beyond the residual window quantized (KIVI's order: a token
        leaves the full-precision residual a group at a time)."""
        storage, dtype = plan.storage, self.dtype
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
                if live.dtype != (storage.float_dtype or dtype):
                    self._set(slot, live.to(storage.float_dtype or dtype))
                continue
            if live.dtype != dtype:
                live = live.to(dtype)
                self._set(slot, live)
            moved = storage.quantized_length(live.shape[2])
            if moved:
                self.packed[slot] = concat(
                    packed, quantize(live[:, :, :moved], storage.bits, storage.group, axis)
                )
                self._keep_residual(slot, live[:, :, moved:], plan)

    def _keep_residual(self, slot: str, residual: Tensor, plan: GroupPlan) -> None:
        """Store `residual` (a view into a larger tensor) in a buffer of its own with room for the
        tokens decoded until its next group is quantized."""
        if not plan.in_place:
            self._set(slot, residual.clone())
            return
        length = residual.shape[2]
        capacity = self._capacity(slot, length, False, plan)
        buffer = residual.new_empty(*residual.shape[:2], capacity, *residual.shape[3:])
        buffer[:, :, :length] = residual
        self._store(slot, buffer, length)

    # --- in-place buffers (module docstring) -----------------------------------------------------
    def _get(self, slot: str) -> Tensor | None:
        if slot.startswith("extras."):
            return self.extras.get(slot.removeprefix("extras."))
        return getattr(self, slot)

    def _set(self, slot: str, live: Tensor) -> None:
        """Hold `live` in `slot`; a buffer it replaces is let go (never kept alive uncounted)."""
        if slot.startswith("extras."):
            self.extras[slot.removeprefix("extras.")] = live
        else:
            setattr(self, slot, live)
        self.drop_stale_buffer(slot)

    def _append(self, slot: str, new: Tensor, plan: GroupPlan) -> None:
        """Append `new` along dim 2 to the tensor in `slot`: in place when its buffer has room."""
        live = self._get(slot)
        if not plan.in_place:
            self._set(slot, torch.cat([live, new], dim=2))
            return
        length, needed = live.shape[2], live.shape[2] + new.shape[2]
        buffer, view = self._buffers.get(slot, (None, None))
        if view is not live or buffer.shape[2] < needed:  # no buffer, a replaced tensor, or full
            capacity = self._capacity(slot, needed, view is not live, plan)
            buffer = live.new_empty(*live.shape[:2], capacity, *live.shape[3:])
            buffer[:, :, :length] = live
        buffer[:, :, length:needed] = new
        self._store(slot, buffer, needed)

    def _store(self, slot: str, buffer: Tensor, length: int) -> None:
        live = buffer[:, :, :length]
        self._buffers[slot] = (buffer, live)
        self._set(slot, live)

    def store_new(self, slot: str, entries: Tensor, capacity: int) -> None:
        """Store `entries` in a new buffer of `capacity` entries."""
        buffer = entries.new_empty(*entries.shape[:2], capacity, *entries.shape[3:])
        buffer[:, :, : entries.shape[2]] = entries
        self._store(slot, buffer, entries.shape[2])

    def drop_stale_buffer(self, slot: str) -> None:
        """Forget the buffer of `slot` once the slot holds another tensor (a record recomputed out of
        place): the buffer would otherwise stay allocated, uncounted by `capacity_bytes`."""
        held = self._buffers.get(slot)
        if held is not None and held[1] is not self._get(slot):
            del self._buffers[slot]

    @staticmethod
    def _capacity(slot: str, needed: int, first: bool, plan: GroupPlan) -> int:
        """Entries to allocate for `slot` when `needed` no longer fit. `first`: the slot has no buffer
        of its own yet (e.g. the first step after a fork)."""
        storage = plan.storage
        if plan.window is not None:
            return max(needed, plan.window)  # the kept entries and the next token
        if storage.integer and slot in STORED_SLOTS:
            # the residual: it holds residual .. residual + group - 1 entries between quantizations
            return max(needed, storage.residual + storage.group)
        if plan.compresses and plan.budget_len is not None:
            # compressed entries: room for the g tokens decoded before the next compression
            return max(plan.budget_len, needed) + plan.compress_interval
        if first and plan.max_new_tokens:
            # the generation the cache was planned for: of max_new_tokens generated tokens all but
            # the last are fed back, so max_new_tokens - 1 more after this write
            return needed + plan.max_new_tokens - 1
        return 2 * needed

    # --- what it stores --------------------------------------------------------------------------
    def own_tensors(self) -> list[Tensor]:
        """Entries, degrees, entry records and codes (what grows with the entries)."""
        parts = [
            self.keys,
            self.values,
            self.log_degree,
            *self.extras.values(),
            *(t for packed in self.packed.values() for t in packed.tensors()),
        ]
        return [t for t in parts if t is not None]

    def stored_tensors(self) -> list[Tensor]:
        """Everything this group stores: its own tensors, window records and its head ids."""
        heads = [] if self.heads is None else [self.heads]
        return self.own_tensors() + list(self.windows.values()) + heads

    def held_tensors(self) -> list[Tensor]:
        """Every tensor this group keeps alive: what it stores and the buffers behind it (what a
        cache has allocated is the storage behind these, `storage_bytes`)."""
        return self.stored_tensors() + [buffer for buffer, _ in self._buffers.values()]

    def map_batch(self, fn) -> None:
        """Apply `fn` to the batch axis of everything stored (beam search, batch selection)."""
        for attr in ("keys", "values", "log_degree"):
            tensor = getattr(self, attr)
            if tensor is not None and tensor.numel() > 0:
                setattr(self, attr, fn(tensor))
        self.packed = {slot: packed.map(fn) for slot, packed in self.packed.items()}
        for records in (self.extras, self.windows):
            for name, tensor in records.items():
                records[name] = fn(tensor)
        for slot in list(self._buffers):
            self.drop_stale_buffer(slot)

    def degrees_or_zeros(self) -> Tensor:
        if self.log_degree is not None:
            return self.log_degree
        return self.keys.new_zeros(*self.keys.shape[:2], self.length, dtype=torch.float32)

    # --- records and compression -----------------------------------------------------------------
    def record(self, query: Tensor, received: Tensor | None, plan: GroupPlan) -> None:
        """Update the window and entry records with this group's queries [B, H_q, q, D] and the
        attention each entry received (`received` [B, H_g, T], when it tracks attention)."""
        if not plan.keeps_records:
            return
        for name, window in plan.window_records:
            # a copy: a slice would keep the whole tensor it was cut from (the prompt's queries) alive
            recorded = RECORDERS[name].after_attention(self.windows.get(name), query, None)
            self.windows[name] = recorded[:, :, -window:].clone()
        if self.keys is not None and self.keys.dim() == 4 and self.keys.shape[1] == 0:
            return  # every head of the layer is in another group: nothing to record
        for name in plan.entry_records:
            if RECORDERS[name].uses_received and received is None:
                raise RuntimeError(f"this cache records {name}: the attention function must pass `received`")
            self.extras[name] = RECORDERS[name].after_attention(self.extras[name], query, received)
            self.drop_stale_buffer(f"extras.{name}")

    def needs_compression(self, plan: GroupPlan) -> bool:
        """Whether it holds more than the plan lets it (`GroupPlan.compress_above`)."""
        if plan.compress_above is None or self.length == 0 or self.keys.shape[1] == 0:
            return False
        return self.length > plan.compress_above

    def compress(self, plan: GroupPlan, stats: LayerStats) -> None:
        """Shrink this group to the plan's budget, its sinks and recent window untouched; `stats`: its
        layer's (`LayerStats`: the layer, its scaling, the rotary table), without the windows."""
        budget = plan.budget_len
        if self.length <= budget or self.keys.shape[1] == 0:
            return
        n_sink, n_recent = plan.protected_windows()
        self.protected_used = (n_sink, n_recent)
        # A merge or eviction works on the entries in the model's dtype (dequantized when the storage
        # is not); the result is stored in the storage format again (`settle`, below).
        kv = LayerKV(self.read("keys"), self.read("values"), self.degrees_or_zeros(), dict(self.extras))
        stats = dataclasses.replace(stats, windows=self.windows)
        kept = compress_protected(kv, budget, plan.method, stats, n_sink, n_recent)
        # into buffers with room for the g tokens decoded before the next compression
        capacity = self._capacity("keys", budget, True, plan) if plan.in_place else budget
        self.packed.pop("keys", None)
        self.packed.pop("values", None)
        self.store_new("keys", kept.keys, capacity)
        self.store_new("values", kept.values, capacity)
        if plan.merges or self.log_degree is not None:
            self.store_new("log_degree", kept.log_degree, capacity)
        for name in list(self.extras):
            self.store_new(f"extras.{name}", kept.extras[name], capacity)
        self.n_compressions += 1
        if plan.storage.precision != "model":
            self.settle(plan)

    # --- splitting and forking -------------------------------------------------------------------
    def select(self, role: str, heads: Tensor, n_heads: int, plan: GroupPlan) -> HeadGroup:
        """A new group of `role` (its `plan`) holding the KV heads `heads` (of this group's `n_heads`,
        which hold every head of the layer) with their entries, codes, degrees and records as they are now."""
        group = HeadGroup(role, heads)
        group.dtype, group.keys, group.values = self.dtype, self.keys[:, heads], self.values[:, heads]
        group.packed = {slot: packed.heads(heads) for slot, packed in self.packed.items()}
        if plan.keeps_records:
            group.log_degree = None if self.log_degree is None else self.log_degree[:, heads]
            group.extras = {name: record[:, heads] for name, record in self.extras.items()}
            group.windows = {
                name: query_rows(window, heads, n_heads) for name, window in self.windows.items()
            }
        return group

    def fork(self, plan: GroupPlan, as_seen: bool) -> HeadGroup:
        """A group for another cache (whose `plan` it gets) that shares this one's tensors (never
        modified in place), with only the records that plan keeps. `as_seen`: its entries are the
        tokens seen, one each (never compressed), so records that start from them can be rebuilt."""
        twin = HeadGroup(self.role, self.heads)
        twin.dtype, twin.keys, twin.values, twin.log_degree = (
            self.dtype,
            self.keys,
            self.values,
            self.log_degree,
        )
        twin.packed = dict(self.packed)  # codes are never modified in place: shared until replaced
        twin.n_compressions, twin.protected_used = self.n_compressions, self.protected_used
        if not plan.keeps_records:
            return twin
        for name in plan.entry_records:
            if name in self.extras:
                twin.extras[name] = self.extras[name]
            elif RECORDERS[name].rebuildable and as_seen:
                shape = (*self.keys.shape[:2], self.length)
                twin.extras[name] = RECORDERS[name].initial(0, shape, self.keys.device)
            else:
                raise ValueError(
                    f"{plan.label} needs {name!r}, which the source cache did not record; {FORK_NEEDS_FIX}"
                )
        for name, window in plan.window_records:
            if name not in self.windows or self.windows[name].shape[2] < window:
                raise ValueError(
                    f"{plan.label} needs a {name!r} window of {window}, which the source cache did not "
                    f"keep; {FORK_NEEDS_FIX}"
                )
            # the fork's own copy: a view would keep the source's whole window (and, for the shared
            # prefill, its storage) alive for as long as the fork lives (kv_bytes counts it)
            twin.windows[name] = self.windows[name][:, :, -window:].clone()
        return twin


# How to fix a fork whose source cache did not record what the method needs (the end of that error).
FORK_NEEDS_FIX = (
    "record it in the source: pass needs=needs_of([...the methods you will fork to]) to "
    "centroidkv.plan.decoding.prefill, or needs=... to the source CompressedCache"
)


def storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`: a view counts the whole storage it keeps
    alive (a buffer's headroom, a source cache's buffer a fork shares), each storage once."""
    storages, unplaced = {}, 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() == 0:  # no memory to tell apart (a meta-device tensor): its own size
            unplaced += tensor.numel() * tensor.element_size()
        else:
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) + unplaced


def query_rows(window: Tensor, kv_heads: Tensor, n_kv_heads: int) -> Tensor:
    """The rows of a window record [B, H_q, w, ...] that belong to the query heads of `kv_heads` (of
    `n_kv_heads`; KV head h's query heads are rows h * group .. h * group + group - 1)."""
    return window.unflatten(1, (n_kv_heads, -1))[:, kv_heads].flatten(1, 2)
