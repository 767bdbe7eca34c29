"""Paper-shaped random models: the published shapes, the depth suffix, and a bf16 run on CPU."""

import math

import pytest
import torch

from centroidkv import CompressedCache, get_method, load_model
from centroidkv.models.loading import check_model_name, parse_model_name

# The published config.json values (Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3, Qwen2-7B-Instruct).
PUBLISHED = {
    "random-llama3.1-8b": dict(
        layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
        rope_theta=500000.0, qkv_bias=False,
    ),
    "random-mistral-7b": dict(
        layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=32768,
        rope_theta=1000000.0, qkv_bias=False,
    ),
    "random-qwen2-7b": dict(
        layers=28, hidden=3584, q_heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064,
        rope_theta=1000000.0, qkv_bias=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", PUBLISHED)
def test_shapes_equal_published_configs(name):
    model, tokenizer = load_model(name, device="meta", dtype=torch.bfloat16)  # shapes, no memory
    expected = PUBLISHED[name]
    hidden, head_dim = expected["hidden"], expected["head_dim"]
    assert tokenizer is None
    assert len(model.model.layers) == expected["layers"]
    assert model.model.embed_tokens.weight.shape == (expected["vocab"], hidden)
    assert model.lm_head.weight.shape == (expected["vocab"], hidden)
    attention, mlp = model.model.layers[-1].self_attn, model.model.layers[-1].mlp
    assert attention.q_proj.weight.shape == (expected["q_heads"] * head_dim, hidden)
    assert attention.k_proj.weight.shape == (expected["kv_heads"] * head_dim, hidden)
    assert attention.v_proj.weight.shape == (expected["kv_heads"] * head_dim, hidden)
    assert attention.o_proj.weight.shape == (hidden, expected["q_heads"] * head_dim)
    assert (attention.q_proj.bias is not None) == expected["qkv_bias"]
    assert mlp.gate_proj.weight.shape == (expected["intermediate"], hidden)
    assert mlp.down_proj.weight.shape == (hidden, expected["intermediate"])
    assert not model.config.tie_word_embeddings
    assert model.config.rope_parameters["rope_theta"] == expected["rope_theta"]
    assert model.dtype == torch.bfloat16


def test_llama3_rope_scaling():
    model, _ = load_model("random-llama3.1-8b:1", device="meta", dtype=torch.bfloat16)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192
    assert model.config.max_position_embeddings == 131072


def test_depth_suffix_and_kwarg():
    assert parse_model_name("random-qwen2-7b:3") == ("random-qwen2-7b", 3)
    assert parse_model_name("random-qwen2-7b") == ("random-qwen2-7b", None)
    by_name, _ = load_model("random-mistral-7b:3", device="meta")
    by_kwarg, _ = load_model("random-mistral-7b", device="meta", n_layers=3)
    assert len(by_name.model.layers) == len(by_kwarg.model.layers) == 3
    for bad in (
        "random-qwen2-7b:0",
        "random-qwen2-7b:29",
        "random-qwen2-7b:x",
        "smollm2-135m:2",
        "random-gpt",
    ):
        with pytest.raises(ValueError):
            check_model_name(bad)


def test_seeded_weights():
    first, _ = load_model("random-mistral-7b:1", dtype=torch.bfloat16, device="cpu", seed=3)
    weight = first.model.layers[0].self_attn.k_proj.weight.clone()
    del first
    again, _ = load_model("random-mistral-7b:1", dtype=torch.bfloat16, device="cpu", seed=3)
    assert torch.equal(again.model.layers[0].self_attn.k_proj.weight, weight)
    assert weight.float().std().item() == pytest.approx(again.config.initializer_range, rel=0.05)
    assert torch.equal(again.model.norm.weight, torch.ones_like(again.model.norm.weight))


PROMPT_LEN = 512  # long enough for a compression of the middle (16 sinks + 64 recent of 129 kept)


@pytest.mark.slow  # 90 s where the CPU's bf16 matmul is slow (no AVX-512)
def test_mistral7b_two_layers_bf16_prefill_compress_decode():
    """A paper's model, cut to 2 layers, in bf16: prefill 512 tokens, compress to 0.25, decode.
    Mistral-7B has Llama-3.1-8B's attention (32 query / 8 KV heads of 128) and a quarter of its
    vocabulary, so its random weights fill in a third of the time."""
    model, _ = load_model("random-mistral-7b:2", dtype=torch.bfloat16, device="cpu")
    assert model.model.embed_tokens.weight.shape == (32768, 4096) and len(model.model.layers) == 2
    ids = torch.randint(0, 32768, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    # no outlier heads: "auto" would calibrate this random model on first use (minutes on a CPU)
    cache = CompressedCache(
        get_method("centroidkv", heads="none"), budget=0.25, max_new_tokens=4, budget_unit="entries"
    )
    with torch.inference_mode():
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
        budget = int(0.25 * (PROMPT_LEN + 4))
        assert cache.seq_lengths() == [budget, budget]
        assert cache.layers[0].keys.dtype == torch.bfloat16
        steps = []
        for _ in range(3):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(token, past_key_values=cache, logits_to_keep=1).logits
            steps.append(logits)
    assert all(bool(torch.isfinite(step).all()) for step in steps)
    assert cache.get_seq_length() == PROMPT_LEN + 3
    degrees = cache.layers[1].main.log_degree.exp().sum(-1)  # every original token is counted once
    assert torch.allclose(degrees, torch.full_like(degrees, PROMPT_LEN + 3), rtol=1e-3)
    assert math.isfinite(float(steps[-1].float().abs().max()))
