"""A prefill that records the attention each entry receives (H2O, CaM) computes its output and its records
in one pass over the logits, in query blocks: the keys and values of a plain prefill (SDPA's causal
kernel) to float32 rounding, and the records of the blocked softmax it replaced."""

from __future__ import annotations

import pytest
import torch

import centroidkv.attention as attention
from centroidkv.attention import attention_with_received, prefill_with_received
from centroidkv.needs import ATTENTION_SUM
from centroidkv.plan.decoding import prefill

pytestmark = pytest.mark.usefixtures("one_thread")


def float64_attention(query, keys, values, scaling):
    """The causal attention and what each key receives, computed in float64: the truth to compare with."""
    group, length = query.shape[1] // keys.shape[1], query.shape[2]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    logits = (query.double() @ keys.transpose(-1, -2)) * scaling
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probabilities = logits.masked_fill(future, float("-inf")).softmax(-1)
    received = probabilities.unflatten(1, (-1, group)).sum(dim=(2, 3))
    return (probabilities @ values).transpose(1, 2), received


@pytest.mark.parametrize("length,scale", [(1, 1.0), (37, 1.0), (300, 3.0), (300, 40.0)])
def test_the_one_pass_is_as_exact_as_sdpa_and_the_blocked_softmax(length, scale):
    """40x logits spread the rows' log-sum-exp over 100s, as a sink token's rows do in real models; there
    every float32 path is about 2e-5 off, and the one pass must stay within twice the others' error."""
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(2, 6, length, 16, generator=generator) * scale
    keys, values = (torch.randn(2, 2, length, 16, generator=generator) for _ in range(2))
    true_output, true_received = float64_attention(query, keys, values, 0.25)
    blocked_output, blocked_received = attention_with_received(query, keys, values, None, 0.25)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, is_causal=True, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    output, received = prefill_with_received(query, keys, values, 0.25)

    def error(found, truth, relative=False):
        difference = (found.double() - truth).abs()
        return (difference / truth.abs().clamp_min(1e-6) if relative else difference).max().item()

    assert error(output, true_output) <= 2 * max(error(sdpa, true_output), 5e-7)
    assert error(received, true_received, True) <= 2 * max(error(blocked_received, true_received, True), 5e-7)
    assert error(blocked_output.transpose(1, 2), true_output) <= 1e-4  # the reference itself is sound


@pytest.mark.parametrize("block", [1, 5, 16, 122, 123, 500])
def test_any_query_block_gives_the_same_output_and_received_attention(block):
    """Blocks that cut the diagonal anywhere, leave a short last block, or hold every query."""
    generator = torch.Generator().manual_seed(block)
    query = torch.randn(1, 6, 123, 16, generator=generator) * 3
    keys, values = (torch.randn(1, 3, 123, 16, generator=generator) for _ in range(2))
    expected_output, expected_received = attention_with_received(query, keys, values, None, 0.25)
    output, received = prefill_with_received(query, keys, values, 0.25, block)
    torch.testing.assert_close(output, expected_output.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(received, expected_received, rtol=2e-5, atol=1e-5)


def test_a_recording_prefill_keeps_the_plain_prefills_keys_and_the_old_records(tiny_model, monkeypatch):
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    plain = prefill(tiny_model, ids, 4)
    recorded = prefill(tiny_model, ids, 4, needs=[ATTENTION_SUM])
    monkeypatch.setattr(  # the path before: every prefill with records through the blocked softmax
        attention,
        "prefill_with_received",
        lambda q, k, v, s: (lambda o, r: (o.transpose(1, 2).contiguous(), r))(
            *attention_with_received(q, k, v, None, s)
        ),
    )
    blocked = prefill(tiny_model, ids, 4, needs=[ATTENTION_SUM])
    assert torch.equal(recorded.first_token, plain.first_token)
    for plain_layer, layer, old in zip(
        plain.cache.layers, recorded.cache.layers, blocked.cache.layers, strict=True
    ):
        for name in ("keys", "values"):
            torch.testing.assert_close(
                layer.main.read(name), plain_layer.main.read(name), rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(layer.main.read(name), old.main.read(name), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            layer.main.extras.get("attention_sum"), old.main.extras.get("attention_sum"), rtol=1e-5, atol=1e-5
        )
