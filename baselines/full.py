"""Full cache: the reference that never compresses (every token keeps its own entry)."""

from __future__ import annotations

from dataclasses import dataclass

from centroidkv.methods import LayerKV, LayerStats, Method, register


@register
@dataclass
class FullCache(Method):
    name = "full"
    label = "Full cache"
    compresses = False

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        return kv
