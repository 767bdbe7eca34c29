"""A prefill that records the attention each entry receives (H2O, CaM) takes SDPA's causal kernel plus
one tiled pass over the logits: the same keys and values as a plain prefill, bit for bit, and the same
records as the blocked softmax it replaced."""

from __future__ import annotations

import pytest
import torch

import centroidkv.attention as attention
from centroidkv.attention import attention_with_received, prefill_with_received, received_attention
from centroidkv.needs import ATTENTION_SUM
from centroidkv.plan.decoding import prefill

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("length,scale", [(1, 1.0), (37, 1.0), (300, 3.0), (300, 40.0)])
def test_the_logits_pass_equals_the_blocked_softmax(length, scale):
    """40x logits spread the rows' log-sum-exp over 100s, as a sink token's rows do in real models."""
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(2, 6, length, 16, generator=generator) * scale
    keys, values = (torch.randn(2, 2, length, 16, generator=generator) for _ in range(2))
    expected_output, expected_received = attention_with_received(query, keys, values, None, 0.25)
    output, received = prefill_with_received(query, keys, values, 0.25)
    torch.testing.assert_close(output, expected_output.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(received, expected_received, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [(7, 11), (16, 5), (1, 300), (512, 512)])
def test_any_tiling_gives_the_same_received_attention(tile):
    """Tiles that cut the diagonal anywhere, taller than wide and the other way round, or hold it all."""
    generator = torch.Generator().manual_seed(sum(tile))
    query = torch.randn(1, 6, 123, 16, generator=generator) * 3
    keys, values = (torch.randn(1, 3, 123, 16, generator=generator) for _ in range(2))
    _, expected = attention_with_received(query, keys, values, None, 0.25)
    repeated = [t.repeat_interleave(2, dim=1) for t in (keys, values)]
    lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, *repeated, 0.0, True, scale=0.25)[
        1
    ]
    torch.testing.assert_close(
        received_attention(query, keys, lse, 0.25, tile), expected, rtol=2e-5, atol=1e-5
    )


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
            assert torch.equal(layer.main.read(name), plain_layer.main.read(name))
            torch.testing.assert_close(layer.main.read(name), old.main.read(name), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            layer.main.extras.get("attention_sum"), old.main.extras.get("attention_sum"), rtol=1e-5, atol=1e-5
        )
