"""PyramidKV: SnapKV's selection with layer budgets that shrink linearly from the first layer to
the last, for the same total budget.

Paper: Cai, Zhang, Gao, Liu, Liu, Lu, Xiong, Dong, Hu, Xiao, "PyramidKV: Dynamic KV Cache
Compression based on Pyramidal Information Funneling" (arXiv 2406.02069). Lower layers attend
broadly and get more cache, higher layers attend to few tokens and get less.

Allocation (the formula of the PyramidKV code, KVCache-Factory `pyramidkv_utils.py`, also used by
kvpress's `PyramidKVPress`): with b = B - n_sink - n_recent the average budget of the compressible
middle, the middle budgets go linearly from `max = 2b - b/beta` at layer 0 to `min = b/beta` at the
last layer, so their mean is b and the total over the layers is the same as SnapKV's. We round
cumulative sums, so the integer budgets add up to exactly n_layers * b; each middle budget is at
least 1. A layer whose budget exceeds its length simply keeps everything (then the model keeps
fewer tokens in total than SnapKV would; the PyramidKV code caps the top at the prompt length and
raises `min` in exchange, which kvpress mirrors; we do not redistribute).

Parameters: those of SnapKV (window_size 32, kernel_size 5, pooling "avgpool", n_sink 0,
n_recent 32, g 64) and
  beta: steepness of the pyramid, min = b / beta (paper's code and kvpress: 20), >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from baselines.snapkv import SnapKV
from centroidkv.methods import param, register


@register
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    label = "PyramidKV"

    beta: float = param(20.0, minimum=1.0, maximum=float("inf"))

    def layer_budget(self, budget_len: int, layer_idx: int, n_layers: int) -> int:
        protected = self.n_sink + self.n_recent
        middle = budget_len - protected
        if n_layers <= 1 or middle <= 0:
            return budget_len
        low = middle / self.beta
        high = 2 * middle - low
        step = (high - low) / (n_layers - 1)

        def cumulative(n: int) -> float:  # sum of the first n layers' exact middle budgets
            return n * high - step * n * (n - 1) / 2

        share = round(cumulative(layer_idx + 1)) - round(cumulative(layer_idx))
        return protected + max(1, share)
