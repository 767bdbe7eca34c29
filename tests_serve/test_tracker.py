"""A compression in vLLM's paged cache (`centroidkv_vllm.tracker.compress_layer`), checked by the
invariants of degree-weighted merging (arXiv 2506.11418, Sec. 3) rather than by re-running it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_paged import HEADS, paged_request  # noqa: E402

from centroidkv.kv import LayerStats  # noqa: E402
from centroidkv_vllm.config import CentroidConfig  # noqa: E402
from centroidkv_vllm.paged import read_entries  # noqa: E402
from centroidkv_vllm.tracker import LayerCache, compress_layer  # noqa: E402

STATS = LayerStats(layer_idx=0, n_layers=1, scaling=0.125)


def compressed(length: int, budget: int, config: CentroidConfig, rounds: int = 1):
    kv_cache, row, slots, keys, values = paged_request(length)
    layer = LayerCache(kv_cache, "vec")
    method = config.method()
    for _ in range(rounds):
        compress_layer(layer, slots, budget, method, STATS)
    kept = slots[length - budget :]  # the merged entries go to the last `budget` slots
    out_k, out_v = read_entries(kv_cache, kept)
    return keys.transpose(0, 1), values.transpose(0, 1), out_k, out_v, layer.log_degree[kept].t()


def test_sinks_and_recent_window_are_kept_and_every_token_is_counted_once():
    config = CentroidConfig(n_sink=16, n_recent=64)
    keys, values, out_k, out_v, log_degree = compressed(700, 300, config)
    assert out_k.shape == (HEADS, 300, keys.shape[-1])
    assert torch.equal(out_k[:, :16], keys[:, :16]) and torch.equal(out_v[:, :16], values[:, :16])
    assert torch.equal(out_k[:, -64:], keys[:, -64:]) and torch.equal(out_v[:, -64:], values[:, -64:])
    degree = log_degree.exp()
    assert torch.allclose(degree.sum(dim=1), torch.full((HEADS,), 700.0), atol=1e-3)
    assert (degree[:, :16] == 1).all() and (degree[:, -64:] == 1).all() and (degree > 1).any()


def test_degree_weighted_sums_of_keys_and_values_are_preserved():
    """sum_i n_i k_i over the entries equals the sum of the original keys (to bf16 rounding of the
    centroids), as merging into degree-weighted means must give."""
    keys, values, out_k, out_v, log_degree = compressed(700, 300, CentroidConfig())
    degree = log_degree.exp().unsqueeze(-1)
    for original, merged in ((keys, out_k), (values, out_v)):
        expected = original.double().sum(dim=1)
        got = (merged.double() * degree.double()).sum(dim=1)
        assert (got - expected).abs().max().item() < 0.01 * expected.abs().max().item()  # measured 0.2 %


def test_a_second_compression_keeps_the_earlier_degrees():
    """Compressing entries that already hold centroids (decoding's re-compression) still counts every
    original token once: the stored log-degrees are read back, not reset."""
    kv_cache, row, slots, _, _ = paged_request(700)
    layer = LayerCache(kv_cache, "vec")
    method = CentroidConfig().method()
    compress_layer(layer, slots, 400, method, STATS)
    compress_layer(layer, slots[-400:], 250, method, STATS)
    degree = layer.log_degree[slots[-250:]].exp()
    assert torch.allclose(degree.sum(dim=0), torch.full((HEADS,), 700.0), atol=1e-3)
