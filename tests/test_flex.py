"""Fused attention paths (centroidkv.flex) against the reference SDPA-with-bias path, on CPU."""

import pytest
import torch

from centroidkv import CompressedCache, load_model
from centroidkv.attention import _biased_attention
from centroidkv.flex import attention_backend, flash_attn_available, flex_available, flex_degree_attention

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention"),
]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_inputs(q_len, kv_len, dtype, degrees=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 8, q_len, 32, generator=gen).to(dtype)
    key = torch.randn(2, 2, kv_len, 32, generator=gen).to(dtype)
    value = torch.randn(2, 2, kv_len, 32, generator=gen).to(dtype)
    log_degree = torch.rand(2, 2, kv_len, generator=gen) * 3 if degrees else None
    return query, key, value, log_degree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,kv_len", [(1, 77), (7, 200), (130, 130), (96, 300)])
@pytest.mark.parametrize("degrees", [True, False])
def test_flex_equals_reference(dtype, q_len, kv_len, degrees):
    query, key, value, log_degree = random_inputs(q_len, kv_len, dtype, degrees)
    reference = _biased_attention(query, key, value, log_degree, 32**-0.5, 0.0)
    fused = flex_degree_attention(query, key, value, log_degree, 32**-0.5)
    assert fused.shape == reference.shape == (2, q_len, 8, 32)
    assert fused.dtype == dtype
    torch.testing.assert_close(fused.float(), reference.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_flex_sees_the_degrees():
    """The check above can fail: with the degrees dropped the outputs differ."""
    query, key, value, log_degree = random_inputs(3, 50, torch.float32)
    reference = _biased_attention(query, key, value, log_degree, 32**-0.5, 0.0)
    without = flex_degree_attention(query, key, value, None, 32**-0.5)
    assert (without - reference).abs().max() > 1e-2


def test_model_through_flex_equals_sdpa_path():
    """Prefill, compression, a fed question (q > 1 after compression) and decode steps: same logits."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 512, (1, 400), generator=torch.Generator().manual_seed(1))
    runs = {}
    for backend in ("sdpa", "flex"):
        cache = CompressedCache("centroidkv", budget=0.5, max_new_tokens=8)
        logits = []
        with attention_backend(backend), torch.inference_mode():
            logits.append(model(ids[:, :380], past_key_values=cache).logits)
            with cache.paused():
                logits.append(model(ids[:, 380:390], past_key_values=cache).logits)
            for position in range(390, 395):
                logits.append(model(ids[:, position : position + 1], past_key_values=cache).logits)
        assert cache.layers[0].main.log_degree is not None and cache.layers[0].main.log_degree.max() > 0
        runs[backend] = logits
    for reference, fused in zip(runs["sdpa"], runs["flex"]):
        torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        with attention_backend("triton"):
            pass


@pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_attn_available()),
    reason="flash-attn needs CUDA and the gpu extra",
)
def test_flash_prefill_equals_reference():
    from centroidkv.flex import flash_prefill

    query, key, value, _ = (t.cuda() if t is not None else t for t in random_inputs(64, 64, torch.bfloat16))
    reference = _biased_attention(query, key, value, None, 32**-0.5, 0.0)
    torch.testing.assert_close(flash_prefill(query, key, value, 32**-0.5), reference, atol=2e-2, rtol=2e-2)


def test_compiled_flex_equals_reference():
    """The CUDA path's compiled kernel (dynamic shapes), built for the CPU: several queries after a
    compression, then decode steps whose cache length changes (no recompilation). ~30 s to compile.
    The masked call comes first: on a CPU, torch 2.13's C++ code generator fails to recompile the
    masked kernel after another variant was compiled (a CppCompileError, not a wrong result)."""
    for q_len, kv_len in ((6, 150), (1, 77), (1, 78)):
        query, key, value, log_degree = random_inputs(q_len, kv_len, torch.float32, seed=kv_len)
        reference = _biased_attention(query, key, value, log_degree, 32**-0.5, 0.0)
        fused = flex_degree_attention(query, key, value, log_degree, 32**-0.5, compiled=True)
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
