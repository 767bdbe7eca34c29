"""The plugin's settings, read from vLLM's `additional_config["centroidkv"]`, and what it refuses.

Budgets follow the harness (`centroidkv.budget`, in entries): each request keeps B = R * (n + Gamma)
entries per layer and KV head, n its prompt length and Gamma `max_new_tokens`; it is compressed to B
once the whole prompt is in (when n > B) and again whenever it has grown to B + g (g =
`compress_interval`). The first `n_sink` and last `n_recent` entries are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from centroidkv.budget import check_budget

CONFIG_KEY = "centroidkv"
SUPPORTED_ISAS = ("vec", "vec16")  # the CPU kernels whose block layout `centroidkv_vllm.paged` reads


@dataclass(frozen=True)
class CentroidConfig:
    """budget: R in (0, 1]; max_new_tokens: Gamma of the budget's reference n + Gamma; the rest are the
    `CentroidKV` method's parameters (`centroidkv/centroidkv.py`), with its defaults."""

    budget: float = 1.0
    max_new_tokens: int = 256
    compress_interval: int = 64
    n_sink: int = 16
    n_recent: int = 64
    chunk_size: int = 256
    schedule: str = "adaptive"
    r_min: float = 0.1
    # every decoding row through the plugin's float32 attention, not only those holding centroids:
    # a reference for benchmarks (at R = 1, the full cache through the plugin's own attention)
    own_attention: bool = False
    # decoding rows of a bf16 cache through the C++ loop (centroidkv_vllm.compiled); False: PyTorch's
    compiled_attention: bool = True

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> CentroidConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"centroidkv: unknown setting(s) {unknown}; known: {sorted(names)}")
        config = cls(**settings)
        check_budget(config.budget)
        if config.max_new_tokens < 0 or config.compress_interval < 1:
            raise ValueError("centroidkv: max_new_tokens must be >= 0 and compress_interval >= 1")
        return config


def config_of(vllm_config: Any) -> CentroidConfig | None:
    """The plugin's settings for this engine, None when it is not configured (stock behaviour)."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return None
    return CentroidConfig.from_dict(dict(extra[CONFIG_KEY]))


def refusal(vllm_config: Any, isa: str, sliding_window: int) -> str | None:
    """One line naming the first vLLM feature this engine uses that the plugin does not support."""
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        return "centroidkv: prefix caching is not supported (merged blocks are rewritten); pass enable_prefix_caching=False"
    if vllm_config.speculative_config is not None:
        return "centroidkv: speculative decoding is not supported (a draft's entries would be merged)"
    if str(cache.cache_dtype) != "auto":
        return f"centroidkv: kv_cache_dtype={cache.cache_dtype} is not supported; use the model's dtype"
    if isa not in SUPPORTED_ISAS:
        return f"centroidkv: the CPU attention ISA {isa!r} is not supported (block layout of {SUPPORTED_ISAS} only)"
    if sliding_window > 0:
        return "centroidkv: sliding-window attention is not supported"
    return None
