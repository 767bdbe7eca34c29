"""The compressed KV cache: keys, values and log-degrees per layer, and the paper's budget policy.

Budget (PAPER.md): B = R * (n + Gamma) tokens per layer, R the budget ratio, n the prompt length,
Gamma the maximum number of new tokens. After the prefill forward the cache is compressed to B when
n > B; while decoding it is compressed back to B whenever it reaches B + g (g = the method's
`compress_interval`). The first `n_sink` and last `n_recent` tokens are never given to the method.

Compression happens at the end of each layer's attention call (the attention function calls
`CompressedLayer.after_attention`), so the prefill attention always sees the full prompt and a
layer's full-size tensors are released as soon as that layer is done. Tensors are replaced by
smaller ones: memory shrinks for real.

Two lengths are kept apart: `get_seq_length()` reports the tokens *seen* (transformers derives
position ids from it, and new tokens must keep their original positions), while the physical length
(`seq_lengths()`, `get_mask_sizes`) is what is stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from centroidkv.kv import LayerKV, LayerStats
from centroidkv.methods import Method, get_method


class CompressedLayer(DynamicLayer):
    """One layer's entries: `keys`/`values` [B, H, T, D], `log_degree` [B, H, T] (None = all degrees 1)."""

    def __init__(self, owner: CompressedCache, layer_idx: int):
        super().__init__()
        # A weak reference: a strong one would make cache <-> layer a reference cycle, and every
        # dropped cache (one per fork) would hold its tensors until Python's cycle collector runs.
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.log_degree: Tensor | None = None
        self.attention_sum: Tensor | None = None  # [B, H, T], for methods that accumulate attention
        self.queries: Tensor | None = None  # the latest query states, for query-aware methods
        self.scaling: float = 1.0
        self.n_seen = 0  # tokens this layer has seen (positions), not what it stores
        self.prompt_len: int | None = None  # length of the first update (the prefill)
        self.n_compressions = 0

    @property
    def owner(self) -> CompressedCache:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("this cache layer outlived its CompressedCache")
        return owner

    # --- transformers' layer interface -------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None):
        if self.owner.n_layers is None:
            raise RuntimeError(
                "CompressedCache needs a model prepared by centroidkv (load_model or prepare_model): "
                "its attention adds log-degrees and triggers compression"
            )
        keys, values = super().update(key_states, value_states, cache_kwargs)
        batch, heads, new_tokens = key_states.shape[:3]
        zeros = key_states.new_zeros(batch, heads, new_tokens, dtype=torch.float32)
        if self.log_degree is not None:
            self.log_degree = torch.cat([self.log_degree, zeros], dim=-1)
        if self.owner.tracks_attention:
            self.attention_sum = (
                zeros if self.attention_sum is None else torch.cat([self.attention_sum, zeros], -1)
            )
        if self.prompt_len is None:
            self.prompt_len = new_tokens
        self.n_seen += new_tokens
        return keys, values

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
        for attr in ("keys", "values", "log_degree", "attention_sum", "queries"):
            tensor = getattr(self, attr)
            if tensor is not None and tensor.numel() > 0:
                setattr(self, attr, fn(tensor))

    # --- compression -----------------------------------------------------------------------------
    @property
    def tracks_attention(self) -> bool:
        return self.owner.tracks_attention

    @property
    def length(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    @property
    def budget_len(self) -> int | None:
        """B for this layer, known once the prompt length is."""
        if self.prompt_len is None:
            return None
        total = int(self.owner.budget * (self.prompt_len + self.owner.max_new_tokens))
        return self.owner.method.layer_budget(total, self.layer_idx, self.owner.n_layers)

    def degrees_or_zeros(self) -> Tensor:
        if self.log_degree is not None:
            return self.log_degree
        return self.keys.new_zeros(self.keys.shape[:3], dtype=torch.float32)

    def after_attention(self, query: Tensor, scaling: float, received: Tensor | None = None) -> None:
        """Called by the attention function once this layer's attention output is computed.

        `received` ([B, H_kv, T]): the attention each entry got from `query`, which the attention
        function computes alongside its output when the cache tracks attention.
        """
        self.scaling = scaling
        if window := self.owner.query_window:
            recent = query if self.queries is None else torch.cat([self.queries, query], dim=2)
            self.queries = recent[:, :, -window:]
        if self.tracks_attention:
            if received is None:
                raise RuntimeError("this cache tracks attention: the attention function must pass `received`")
            self.attention_sum = self.attention_sum + received
        if self.needs_compression():
            self.compress()

    def needs_compression(self) -> bool:
        if not (self.owner.compression_enabled and self.owner.method.compresses):
            return False
        limit = self.budget_len
        if self.n_seen > self.prompt_len:  # decoding: let g tokens accumulate before re-compressing
            limit += self.owner.method.compress_interval - 1
        return self.length > limit

    def compress(self) -> None:
        """Shrink this layer to its budget, leaving sinks and the recent window untouched."""
        method, length, budget = self.owner.method, self.length, self.budget_len
        n_sink, n_recent = method.n_sink, method.n_recent
        if length <= budget:
            return
        self.check_protected_fit()
        middle = slice(n_sink, length - n_recent)
        log_degree = self.degrees_or_zeros()
        segment = LayerKV(
            self.keys[:, :, middle],
            self.values[:, :, middle],
            log_degree[:, :, middle],
            None if self.attention_sum is None else self.attention_sum[:, :, middle],
        )
        stats = LayerStats(
            layer_idx=self.layer_idx,
            n_layers=self.owner.n_layers,
            scaling=self.scaling,
            queries=self.queries,
            keys=self.keys,
            log_degree=log_degree,
            middle=middle,
        )
        target = budget - n_sink - n_recent
        kept = method.compress(segment, target, stats)
        if kept.length != target:
            raise RuntimeError(f"{method.name} returned {kept.length} tokens instead of {target}")

        def splice(full: Tensor, new_middle: Tensor) -> Tensor:
            return torch.cat([full[:, :, :n_sink], new_middle, full[:, :, length - n_recent :]], dim=2)

        self.keys = splice(self.keys, kept.keys)
        self.values = splice(self.values, kept.values)
        if method.merges or self.log_degree is not None:
            self.log_degree = splice(log_degree, kept.log_degree)
        if self.attention_sum is not None:
            self.attention_sum = splice(self.attention_sum, kept.attention_sum)
        self.n_compressions += 1

    def check_protected_fit(self) -> None:
        """Raise when this layer's budget cannot hold the protected sinks and recent window."""
        method, budget = self.owner.method, self.budget_len
        if budget < method.n_sink + method.n_recent + 1:
            raise ValueError(
                f"{method.name}: a budget of {budget} tokens cannot hold n_sink={method.n_sink} + "
                f"n_recent={method.n_recent} protected tokens; raise the budget or lower n_sink/n_recent"
            )

    def fork(self, owner: CompressedCache) -> CompressedLayer:
        """A layer for another cache that shares this one's tensors (never modified in place)."""
        twin = CompressedLayer(owner, self.layer_idx)
        for attr in (
            "keys",
            "values",
            "log_degree",
            "attention_sum",
            "queries",
            "scaling",
            "n_seen",
            "prompt_len",
        ):
            setattr(twin, attr, getattr(self, attr))
        twin.is_initialized, twin.dtype, twin.device = self.is_initialized, self.dtype, self.device
        if not owner.tracks_attention:
            twin.attention_sum = None
        if not owner.query_window:
            twin.queries = None
        return twin


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
      record_queries, record_attention: also keep this many latest queries / the accumulated
        attention although `method` does not need them, so that `fork` can serve methods that do.
    """

    def __init__(
        self,
        method: Method | str = "centroidkv",
        budget: float = 0.25,
        max_new_tokens: int = 0,
        record_queries: int = 0,
        record_attention: bool = False,
    ):
        if isinstance(method, str):
            method = get_method(method)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        super().__init__(layers=[])
        self.method = method
        self.budget = float(budget)
        self.max_new_tokens = max_new_tokens
        self.n_layers: int | None = None  # set by the attention hook (prepare_model)
        self.compression_enabled = True
        self.query_window = max(method.query_window, record_queries)
        self.tracks_attention = method.accumulates_attention or record_attention

    def layer(self, layer_idx: int) -> CompressedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(CompressedLayer(self, len(self.layers)))
        return self.layers[layer_idx]

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

    def fork(self, method: Method | str, budget: float, max_new_tokens: int | None = None) -> CompressedCache:
        """A new cache over the same entries with another method or budget, already compressed.

        This is how one prefill serves many (method, budget) runs: tensors are shared, never copied,
        because compression and decoding replace tensors instead of writing into them. The source
        cache must have collected what the new method needs (query window, accumulated attention).
        """
        twin = CompressedCache(
            method, budget, self.max_new_tokens if max_new_tokens is None else max_new_tokens
        )
        twin.n_layers = self.n_layers
        twin.layers = [layer.fork(twin) for layer in self.layers]
        for layer in twin.layers:
            if twin.method.accumulates_attention and layer.attention_sum is None:
                raise ValueError(
                    f"{twin.method.name} needs accumulated attention the source cache did not keep"
                )
            if twin.method.query_window and (
                layer.queries is None or layer.queries.shape[2] < twin.method.query_window
            ):
                raise ValueError(f"{twin.method.name} needs a query window the source cache did not keep")
        twin.compress_now()
        return twin

    def check_room(self, n_new_tokens: int) -> None:
        """Raise now, not mid-generation, when `n_new_tokens` more decoded tokens will need a compression
        whose budget cannot hold the protected tokens (known as soon as the prompt is in)."""
        for layer in self.layers:
            limit = layer.budget_len + self.method.compress_interval - 1  # as in needs_compression
            if self.method.compresses and layer.length + n_new_tokens > limit:
                layer.check_protected_fit()

    def kv_bytes(self) -> int:
        """Bytes held by the cache's own tensors: keys, values and log-degrees."""
        total = 0
        for layer in self.layers:
            for tensor in (layer.keys, layer.values, layer.log_degree):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total

    def seq_lengths(self) -> list[int]:
        """Stored entries per layer (the physical length, not the tokens seen)."""
        return [layer.length for layer in self.layers]

    @property
    def n_compressions(self) -> int:
        return max((layer.n_compressions for layer in self.layers), default=0)
