"""KIVI: the full-length cache in 2 or 4 bits, keys per channel and values per token.

Paper: Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024 (arXiv 2402.02750). Every token keeps its entry (no eviction,
no merging); the entries are stored as asymmetric min-max integer codes, keys grouped per channel over
`kv_group` consecutive tokens (key outliers sit in fixed channels), values per token over groups of
`kv_group` channels, and the newest `kv_residual` tokens stay in full precision until a whole group
can be quantized. The codes, scales and zeros are implemented by `centroidkv.cache.quantization`, which any
method takes through the storage precision that wraps it (`kv_precision`, `centroidkv.storage_precision`);
this method is the full cache with KIVI's settings (`wrapper_params`).

Parameters (KIVI's main settings): kv_precision "int2" (default, KIVI-2) or "int4" (KIVI-4), kv_group
32, kv_residual 128. Differences: scales and zeros are float16 in both (as KIVI); our residual always
holds the newest 128 .. 128 + 31 tokens (KIVI's key residual empties when it is quantized); no fused
kernels: attention reads a dequantized copy of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from centroidkv.methods import LayerKV, LayerStats, Method, param, register

KIVI_PRECISIONS = ("int2", "int4")


@register
@dataclass
class Kivi(Method):
    name = "kivi"
    label = "KIVI"
    compresses = False

    # KIVI's two storage precisions (`centroidkv.storage_precision`), KIVI-2 by default
    wrapper_params = {
        "kv_precision": param(
            "int2",
            choices=KIVI_PRECISIONS,
            reason="KIVI-2, KIVI-4; other precisions: method full with kv_precision",
        )
    }

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        return kv
