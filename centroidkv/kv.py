"""The data a compression method works on: one layer's cache entries and what was recorded for it.

These types belong to the core (the cache, Chunked Soft Matching) and to every method; the registry of
methods (`centroidkv.methods`) re-exports them so that a method file needs a single import.
What is recorded, and how a record follows the entries, is declared in `centroidkv.needs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class LayerKV:
    """One layer's cache entries, batch B, KV heads H, length T, head dim D.

    `extras` holds the per-entry records the method asked for (`centroidkv.needs`), each [B, H, T]
    float32 and aligned with the entries: e.g. "attention_sum" (accumulated attention) or "position"
    (the entry's degree-weighted mean position).
    """

    keys: Tensor  # [B, H, T, D] as cached (post-RoPE)
    values: Tensor  # [B, H, T, D]
    log_degree: Tensor  # [B, H, T] float32; 0 for an original token, log n for a centroid of n tokens
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    @property
    def attention_sum(self) -> Tensor | None:
        """[B, H, T] accumulated attention (the "attention_sum" record), None when not recorded."""
        return self.extras.get("attention_sum")

    @attention_sum.setter
    def attention_sum(self, value: Tensor | None) -> None:
        if value is None:
            self.extras.pop("attention_sum", None)
        else:
            self.extras["attention_sum"] = value

    def select(self, index: Tensor) -> LayerKV:
        """Keep the tokens at `index` ([B, H, K], per head) along the sequence axis."""

        def rows(x: Tensor) -> Tensor:
            return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

        return LayerKV(
            keys=rows(self.keys),
            values=rows(self.values),
            log_degree=self.log_degree.gather(2, index),
            extras={name: record.gather(2, index) for name, record in self.extras.items()},
        )


@dataclass
class LayerStats:
    """What a method may need besides the entries themselves; filled only for methods that ask.

    `windows` holds the per-layer window records (`centroidkv.needs`), e.g. "queries": the last
    `window` query states seen by this layer (post-RoPE, [B, H_query, w, D]). `keys`/`log_degree` are
    the whole layer (protected tokens included) and `middle` the slice of it that `compress` received,
    so query-aware methods can normalise their attention over the full cache the way the model does.
    `rotary` is the model's rotary embedding module (None when the cache has not met a model), for
    methods that undo RoPE (CentroidKV's pre-RoPE similarity).
    """

    layer_idx: int
    n_layers: int
    scaling: float
    windows: dict[str, Tensor] = field(default_factory=dict)
    keys: Tensor | None = None
    log_degree: Tensor | None = None
    middle: slice = field(default_factory=lambda: slice(0, 0))
    rotary: object | None = None

    @property
    def queries(self) -> Tensor | None:
        """The "queries" window record ([B, H_query, w, D]), None when not recorded."""
        return self.windows.get("queries")
