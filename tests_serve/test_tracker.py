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


def test_heads_kept_whole_go_to_the_side_store_and_the_others_are_merged_alone():
    """heads=whole (`centroidkv_vllm.heads`): at the first compression the listed head's entries go
    to the request's side store as they are; its slots in the pool get zeros (never read again); the
    other heads are merged by the library on their own."""
    from centroidkv.cache.budget import fit_protected
    from centroidkv.compression import compress_protected
    from centroidkv.kv import LayerKV
    from centroidkv_vllm.heads import SideStore

    kv_cache, row, slots, keys, values = paged_request(700)
    reference = kv_cache.clone()
    layer, method, store = LayerCache(kv_cache, "vec"), CentroidConfig().method(), SideStore(headroom=8)
    compress_layer(layer, slots, 300, method, STATS, listed=(1,), store=store)
    kept_k, kept_v = store.read(0)
    assert kept_k.shape == (1, 700, keys.shape[-1])
    assert torch.equal(kept_k[0], keys[:, 1]) and torch.equal(kept_v[0], values[:, 1])
    out_k, out_v = read_entries(kv_cache, slots[-300:])
    assert not out_k[1].any() and not out_v[1].any() and not layer.log_degree[slots[-300:], 1].any()
    # the others: the library's compression of those two heads alone (the harness's main group after
    # the split; CSM's merges depend on which heads it is given, so not those of all three heads)
    ref_k, ref_v = read_entries(reference, slots)
    rest = LayerKV(ref_k[None, [0, 2]], ref_v[None, [0, 2]], torch.zeros(1, 2, 700))
    n_sink, n_recent = fit_protected(300, method.n_sink, method.n_recent, "test")
    kept = compress_protected(rest, 300, method, STATS, n_sink, n_recent)
    for index, head in enumerate((0, 2)):
        assert torch.equal(out_k[head], kept.keys[0, index].to(out_k.dtype))
        assert torch.equal(out_v[head], kept.values[0, index].to(out_v.dtype))
        assert torch.equal(layer.log_degree[slots[-300:], head], kept.log_degree[0, index])
    store.append(0, keys[:5, 1].unsqueeze(0), values[:5, 1].unsqueeze(0))  # a step's tokens grow it
    assert store.read(0)[0].shape[1] == 705 and torch.equal(store.read(0)[0][0, 700:], keys[:5, 1])
