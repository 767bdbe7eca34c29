"""CentroidKV as a kvpress press: `CentroidKVPress`, for kvpress's own pipeline and `with press(model)`.

Method: Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering", arXiv 2506.11418
(`centroidkv.centroidkv`). Press interface: NVIDIA's kvpress (github.com/NVIDIA/kvpress, version
0.5.5), prior art for the pipeline and the `compression_ratio` convention.

    from transformers import pipeline
    from baselines.presses.centroidkv_press import CentroidKVPress   # imports kvpress: the pipeline
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    answer = pipe(context, question=question, press=CentroidKVPress(compression_ratio=0.75))["answer"]

Budget: kvpress keeps `int(n * (1 - compression_ratio))` of an n-token context; so does this press,
and that is this harness's budget R = 1 - compression_ratio counted in entries (`budget_unit="entries"`)
with Gamma = 0 (kvpress sizes the budget on the context alone; the harness's B = R * (n + Gamma)).
Every compressed KV head keeps B = int(R * n) entries (heads kept whole by CentroidKV's head policy
keep every token, as in the native method); the degrees and positions CentroidKV records come on top,
as they do natively under `budget_unit="entries"`. compression_ratio = 0 compresses nothing.

How it runs. Unlike kvpress's own presses, CentroidKV does not stop at the prefill: attention adds
log(degree) to the logits of merged entries while the question and the answer are decoded, and the
cache re-compresses to B whenever decoding has added `compress_interval` entries. So the press is a
`PrefillDecodingPress` (the type kvpress's pipeline also enters for the decoding), and inside
`with press(model)`:
- the model runs CentroidKV's degree-aware attention (`centroidkv.attention.prepare_model`); its own
  attention implementation is restored on exit (prepare_model's two hooks per attention module stay,
  inert for any cache but a `CompressedCache`);
- a forward pre-hook on the language model gives each forward CentroidKV's own cache (a
  `centroidkv.cache.cache.CompressedCache` with the press's method and budget) in place of the caller's
  empty `DynamicCache`, whose `layers` become that cache's layers: the caller's cache holds the
  compressed entries, with really smaller key and value tensors (no masks), and each later forward on
  it (the decoding, in the second `with press(model)` of the pipeline) runs on the same cache. The
  compression is the native one, layer by layer at the end of its attention call, so the entries kept
  are those of native CentroidKV under the context-only protocol (tests/test_centroidkv_press.py);
- a forward of several tokens on a cache that already holds tokens (the pipeline's question) runs with
  compression paused, as the native context-only protocol feeds its question (`CompressedCache.paused`).

Limits: one question per pipeline call (kvpress refuses several for a press that also acts while
decoding: its `_remove_answer_from_cache` would cut the entries of a compressed cache by token counts);
the caller's cache must be an empty `DynamicCache` of full-attention layers (or None, or a
`CompressedCache`, which keeps its own method and budget); the press does not compose with other
presses (`compress` refuses), since it compresses inside its cache, not through kvpress's hooks.

Parameters:
  compression_ratio: the fraction of the context removed, in [0, 1) (kvpress's meaning); R = 1 - it.
  params: CentroidKV's parameters (`centroidkv.centroidkv.CentroidKV`: chunk_size, schedule, n_sink,
    n_recent, heads, ...), the native defaults where not given. heads="whole" (the default) reads the
    model's calibrated outlier heads (shipped for the embedded model; `python -m eval.calibrate`
    writes others'); params={"heads": "none"} compresses every head alike.
  model_name: the model's name for its calibrated heads (default: the name `load_model` gave it, else
    its config's `name_or_path`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from centroidkv.attention import prepare_model
from centroidkv.cache.cache import CompressedCache
from centroidkv.methods import Method, get_method

try:
    from kvpress import PrefillDecodingPress
except ImportError:
    raise ImportError('CentroidKVPress needs kvpress: pip install -e ".[kvpress]"') from None

METHOD = "centroidkv"
BUDGET_UNIT = "entries"  # kvpress's accounting: entries kept of the context

# The CentroidKV cache behind each caller's cache the press has filled (weak keys: it lives as long as
# the caller's cache does). The prefill and the decoding are two `with press(model)` blocks of the
# pipeline; this is how the second finds the cache of the first.
_CACHES: weakref.WeakKeyDictionary[Cache, CompressedCache] = weakref.WeakKeyDictionary()


@dataclass
class CentroidKVPress(PrefillDecodingPress):
    """CentroidKV (arXiv 2506.11418) as a kvpress press; the budget is R = 1 - compression_ratio
    (module docstring)."""

    compression_ratio: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)
    model_name: str | None = None
    # PrefillDecodingPress's wrapped presses: none, CentroidKV acts in both phases itself.
    prefilling_press: None = field(default=None, init=False, repr=False)
    decoding_press: None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.method()  # a bad ratio, parameter or value fails here, with one line

    @property
    def budget(self) -> float:
        """R = 1 - compression_ratio: the fraction of the context each compressed head keeps."""
        return 1.0 - self.compression_ratio

    def method(self) -> Method:
        """The native method this press runs (a new instance: nothing per run is kept on the press)."""
        ratio = self.compression_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"CentroidKVPress: compression_ratio must be a number in [0, 1), got {ratio!r}")
        if not isinstance(self.params, dict):
            raise ValueError(
                f"CentroidKVPress: params must be a mapping of CentroidKV parameters, got {self.params!r}"
            )
        return get_method(METHOD, **self.params) if ratio else get_method("full")

    def new_cache(self) -> CompressedCache:
        """The CentroidKV cache of one context: this press's method at R = 1 - compression_ratio, in
        entries, with Gamma = 0 (kvpress's budget)."""
        return CompressedCache(self.method(), self.budget, max_new_tokens=0, budget_unit=BUDGET_UNIT)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            "CentroidKVPress compresses inside its own cache, not through kvpress's forward hooks: "
            "use it on its own (pipeline(..., press=CentroidKVPress(...)) or `with press(model)`), "
            "not inside another press"
        )

    def forward_hook(self, module, input, kwargs, output):
        return self.compress(module, None, None, None, None, kwargs)

    @contextmanager
    def __call__(self, model: PreTrainedModel) -> Iterator[None]:
        """CentroidKV's cache and degree-aware attention on `model` for the block (module docstring)."""
        self.method()  # the fields may have been changed since construction
        previous_attention = model.config._attn_implementation
        prepare_model(model, self.model_name)
        language_model = getattr(model.model, "language_model", model.model)
        paused: list[CompressedCache] = []  # caches whose compression a forward of this block paused

        def route(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            cache = self.cache_for(kwargs.get("past_key_values"), kwargs.get("use_cache"))
            if cache is None:
                return args, kwargs
            tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            if tokens is None and args:
                tokens = args[0]
            if tokens is not None and tokens.shape[1] > 1 and cache.get_seq_length() > 0:
                cache.compression_enabled = False  # the question, fed as the native protocol does
                paused.append(cache)
            return args, {**kwargs, "past_key_values": cache}

        def resume(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            while paused:
                paused.pop().compression_enabled = True

        hooks = [
            language_model.register_forward_pre_hook(route, with_kwargs=True),
            language_model.register_forward_hook(resume, with_kwargs=True),
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            resume(language_model, (), {}, None)  # a forward that raised leaves no cache paused
            if model.config._attn_implementation != previous_attention:
                model.set_attn_implementation(previous_attention)

    def cache_for(self, cache: Cache | None, use_cache: bool | None) -> CompressedCache | None:
        """The CentroidKV cache a forward given `cache` runs on: a new one for None or an empty
        `DynamicCache` (whose layers become the new cache's), the one already behind a cache this
        press filled, a `CompressedCache` itself; None when the forward keeps no cache."""
        if isinstance(cache, CompressedCache):
            return cache
        if cache is None:
            return None if use_cache is False else self.new_cache()
        if cache in _CACHES:
            return _CACHES[cache]
        empty = cache.get_seq_length() == 0 and all(
            type(layer) is DynamicLayer and not layer.is_initialized for layer in cache.layers
        )
        if type(cache) is not DynamicCache or not empty:
            raise ValueError(
                f"CentroidKVPress needs an empty DynamicCache of full-attention layers (or none) at the "
                f"prefill, got a {type(cache).__name__} holding {cache.get_seq_length()} tokens"
            )
        compressed = self.new_cache()
        cache.layers = compressed.layers  # one list: the caller's cache holds the compressed entries
        _CACHES[cache] = compressed
        return compressed


__all__ = ["CentroidKVPress"]
