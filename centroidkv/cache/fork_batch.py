"""Decode several compressed forks of one prefill as one batch: one weight pass per step for all.

On a CPU (and for small batches on a GPU) a decode step of one sequence is bound by reading the
model's weights, not by its arithmetic. The forks of one prefill (every method and budget of a
sample) have seen the same tokens, so their positions agree step by step: their new tokens can run
through the model together as the rows of one batch, and the weights are read once per step
instead of once per fork.

Only the attention is per fork: every fork keeps its own `CompressedCache` (its own entries, degrees,
heads kept whole, budget and compressions), and the attention function runs each row against its
own fork's layer (`ForkBatchLayer.forks`), so a row computes exactly what it computes alone, up to
the float rounding of the batched matrix products.

`ForkBatch` is a transformers `Cache`: `model(tokens, past_key_values=ForkBatch(caches))` with
`tokens` [F, q], row f belonging to `caches[f]` (each a one-row cache).
"""

from __future__ import annotations

from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from centroidkv.cache.cache import CompressedCache, CompressedLayer
from centroidkv.cache.planner import GroupPlanner


class ForkBatchLayer(DynamicLayer):
    """One layer of a `ForkBatch`: row f of an update goes to fork f's own layer (`forks`), with its
    own cache's planner (`planners`)."""

    def __init__(self, caches: list[CompressedCache], layer_idx: int):
        super().__init__()
        self.caches = caches
        self.forks: list[CompressedLayer] = [cache.layers[layer_idx] for cache in caches]
        self.is_initialized = True

    def planners(self) -> list[GroupPlanner]:
        """Each fork's cache's settings now (`CompressedCache.planner`), in row order."""
        return [cache.planner() for cache in self.caches]

    def update(self, key_states: Tensor, value_states: Tensor, cache_kwargs: dict | None = None):
        for row, (layer, planner) in enumerate(zip(self.forks, self.planners(), strict=True)):
            layer.add(planner, key_states[row : row + 1], value_states[row : row + 1])
        # The attention function reads every fork's own entries (`forks`), never these.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.forks[0].get_seq_length()

    def get_mask_sizes(self, cache_position: Tensor) -> tuple[int, int]:
        return self.forks[0].get_mask_sizes(cache_position)


class ForkBatch(Cache):
    """Forks of one prefill (one row each, the same tokens seen) decoded as the rows of one batch."""

    def __init__(self, caches: list[CompressedCache]):
        if not caches:
            raise ValueError("a fork batch needs at least one cache")
        seen = {cache.get_seq_length() for cache in caches}
        if len(seen) != 1:
            raise ValueError(
                f"forks decoded together must have seen the same tokens, got lengths {sorted(seen)}"
            )
        if any(
            layer.main.keys.shape[0] != 1
            for cache in caches
            for layer in cache.layers
            if layer.main.keys is not None
        ):
            raise ValueError("each fork of a batch must hold one sequence")
        super().__init__(layers=[])
        self.caches = caches
        n_layers = len(caches[0].layers)
        self.layers = [ForkBatchLayer(caches, i) for i in range(n_layers)]
