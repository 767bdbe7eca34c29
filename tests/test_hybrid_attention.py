"""Hybrid local/global attention (`centroidkv.cache.window_layer`): window layers attend over their last W
positions under the degree-aware attention, keep W - 1 entries as transformers' own cache does, are
never compressed, and their bytes count in the budget. Tiny random Gemma 3 and Qwen2 configurations
built here, against transformers' eager attention and DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

from centroidkv import CompressedCache, get_method, prepare_model
from centroidkv.attention import degree_attention
from centroidkv.cache.window_layer import WindowLayer, sliding_windows

WINDOW = 8


def tiny_gemma3(**overrides) -> Gemma3ForCausalLM:
    """Three window layers and a global one; `overrides`: other configuration values."""
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512,
    )
    return Gemma3ForCausalLM(Gemma3TextConfig(**{**values, **overrides}))


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,  # layers 2 and 3 attend over a window
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(config)


def built(factory, implementation: str):
    torch.manual_seed(0)
    model = factory().eval()
    model.set_attn_implementation(implementation)
    return model


@pytest.mark.parametrize("factory", [tiny_gemma3, tiny_qwen2], ids=["gemma3", "qwen2"])
def test_a_hybrid_model_matches_eager_attention_over_prefill_and_decode(factory):
    """The full method through the degree-aware attention gives transformers' eager logits, step by
    step, and each window layer keeps its last W - 1 entries (transformers' own count)."""
    eager = built(factory, "eager")
    ours = prepare_model(built(factory, "eager"))
    assert sliding_windows(ours.config), "the configuration has window layers"
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    reference_cache, cache = DynamicCache(config=eager.config), CompressedCache("full", 1.0, 4)
    with torch.no_grad():
        expected = eager(ids, past_key_values=reference_cache).logits
        got = ours(ids, past_key_values=cache).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        for step in range(4):
            token = expected[:, -1:].argmax(-1)
            expected = eager(token, past_key_values=reference_cache).logits
            got = ours(token, past_key_values=cache).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"decode step {step}")
    windows = sliding_windows(ours.config)
    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, WindowLayer) == (index in windows)
        assert layer.main.length == (WINDOW - 1 if index in windows else 44)


def test_a_window_layer_outputs_eager_attention_for_the_same_inputs():
    """The attention function itself, on a window layer's arguments: eager attention with the
    sliding-window mask transformers builds (query i sees keys i - W + 1 .. i)."""
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    torch.manual_seed(2)
    model = tiny_gemma3().eval()
    module = model.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 20, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
    position = torch.arange(20)
    allowed = (position[None] <= position[:, None]) & (position[:, None] - position[None] < WINDOW)
    mask = torch.zeros(20, 20).masked_fill(~allowed, float("-inf"))[None, None]
    expected, _ = eager_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=0.25)
    module.kv_layer = None
    got, _ = degree_attention(module, query, key, value, None, scaling=0.25, sliding_window=WINDOW)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["centroidkv", "snapkv", "h2o", "streaming_llm"])
def test_a_hybrid_models_compressed_cache_stores_r_of_its_full_cache(method):
    """In bytes, everything stored (window layers included, never compressed) is R times a full cache
    of the same model (window layers at W - 1 entries) within 1 %, and only global layers shrink."""
    model = prepare_model(built(tiny_gemma3, "eager"))
    ids = torch.randint(0, 256, (1, 1000), generator=torch.Generator().manual_seed(3))
    budget, new_tokens = 0.25, 8
    cache = CompressedCache(get_method(method, heads="none"), budget, new_tokens)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.budget_ratio() == pytest.approx(budget, rel=0.01)
    full = CompressedCache("full", 1.0, new_tokens)
    with torch.no_grad():
        model(ids, past_key_values=full)
    assert full.kv_ratio() == 1.0  # a full cache of a hybrid model: window layers at W - 1 entries
    reference = full.kv_bytes() * (3 * (WINDOW - 1) + 1008) / (3 * (WINDOW - 1) + 1000)  # + the 8 new tokens
    assert full.reference_bytes() == reference
    assert cache.kv_bytes() == pytest.approx(budget * reference, rel=0.01)
    assert [layer.main.length for layer in cache.layers[:3]] == [WINDOW - 1] * 3
    assert 0 < cache.layers[3].main.length < budget * 1008  # the global layer pays for the window layers too
