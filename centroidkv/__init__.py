"""CentroidKV: KV cache clustering with Chunked Soft Matching, and the cache it runs in."""

from centroidkv.attention import ATTN_IMPLEMENTATION, prepare_model
from centroidkv.cache import CompressedCache
from centroidkv.kv import LayerKV, LayerStats
from centroidkv.methods import Method, get_method, method_names, register
from centroidkv.models import load_model, load_tokenizer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CompressedCache",
    "LayerKV",
    "LayerStats",
    "Method",
    "get_method",
    "load_model",
    "load_tokenizer",
    "method_names",
    "prepare_model",
    "register",
]
