"""StreamingLLM: attention sinks plus the most recent tokens.

Paper: Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024 (arXiv 2309.17453). The cache keeps the first few tokens (the attention sinks) and a
sliding window of the most recent ones; everything in between is evicted.

In this cache the protected sinks and recent window are stripped by the cache itself, so the method
keeps the *newest* `target_len` tokens of the mergeable middle: together with the protected recent
window they form one contiguous recent window of B - n_sink tokens. The result does not depend on
`n_recent` (any split of the recent window between "protected" and "kept middle" is the same cache).

Parameters:
  n_sink: attention sinks kept at the start (paper: 4).
  n_recent: protected recent window (harness default 64; irrelevant to which tokens survive).
  compress_interval: g, decoding re-compresses every g tokens beyond the budget (harness default 64).

Differences from the paper: the paper re-assigns positions inside the cache (keys are re-rotated
so that positions are contiguous); like kvpress's `StreamingLLMPress` we keep the positions the keys
were cached with. Eviction happens in blocks of g tokens during decoding instead of one per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from centroidkv.methods import LayerKV, LayerStats, Method, register


@register
@dataclass
class StreamingLLM(Method):
    name = "streaming_llm"
    label = "StreamingLLM"

    n_sink: int = 4

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        batch, heads, length = kv.log_degree.shape
        newest = torch.arange(length - target_len, length, device=kv.keys.device)
        return kv.select(newest.expand(batch, heads, target_len))
