"""The data a compression method works on: one layer's cache entries and what was recorded for it.

These types belong to the core (the cache, Chunked Soft Matching) and to every method; the registry of
methods (`centroidkv.methods`) re-exports them so that a method file needs a single import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class LayerKV:
    """One layer's cache entries, batch B, KV heads H, length T, head dim D."""

    keys: Tensor  # [B, H, T, D] as cached (post-RoPE)
    values: Tensor  # [B, H, T, D]
    log_degree: Tensor  # [B, H, T] float32; 0 for an original token, log n for a centroid of n tokens
    attention_sum: Tensor | None = None  # [B, H, T] accumulated attention (methods that ask for it)

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    def select(self, index: Tensor) -> LayerKV:
        """Keep the tokens at `index` ([B, H, K], per head) along the sequence axis."""

        def rows(x: Tensor) -> Tensor:
            return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

        return LayerKV(
            keys=rows(self.keys),
            values=rows(self.values),
            log_degree=self.log_degree.gather(2, index),
            attention_sum=None if self.attention_sum is None else self.attention_sum.gather(2, index),
        )


@dataclass
class LayerStats:
    """What a method may need besides the entries themselves; filled only for methods that ask.

    `queries` holds the last `Method.query_window` query states seen by this layer (post-RoPE,
    [B, H_query, w, D]); `keys`/`log_degree` are the whole layer (protected tokens included) and
    `middle` the slice of it that `compress` received, so query-aware methods can normalise their
    attention over the full cache the way the model does.
    """

    layer_idx: int
    n_layers: int
    scaling: float
    queries: Tensor | None = None
    keys: Tensor | None = None
    log_degree: Tensor | None = None
    middle: slice = field(default_factory=lambda: slice(0, 0))
