"""Chunked Soft Matching and degree-weighted merging, as pure tensor functions."""

import math

import pytest
import torch
import torch.nn.functional as F

import centroidkv.centroidkv
from centroidkv import get_method
from centroidkv.csm import (
    chunk_edges,
    csm_compress,
    match_within_chunks,
    merge_tokens,
    padded_rows,
    top_edges,
    unit_rows,
)
from centroidkv.methods import LayerKV
from centroidkv.needs import merge_rule
from centroidkv.plan.decoding import generate_from, prefill
from centroidkv.schedule import LinearSchedule

pytestmark = pytest.mark.usefixtures("one_thread")


def random_kv(batch=1, heads=2, length=40, dim=8, seed=0) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=gen)
    values = torch.randn(batch, heads, length, dim, generator=gen)
    return LayerKV(keys, values, torch.zeros(batch, heads, length))


def brute_force_edges(keys: torch.Tensor, chunk_size: int) -> dict[int, tuple[float, int]]:
    """For one head: every A position -> (best similarity, best B position) in its chunk, by loops."""
    length = keys.shape[0]
    normed = F.normalize(keys, dim=-1)
    edges = {}
    for a in range(0, length, 2):
        chunk = a // chunk_size
        candidates = [b for b in range(chunk * chunk_size + 1, min((chunk + 1) * chunk_size, length), 2)]
        if candidates:
            scores = [float(normed[a] @ normed[b]) for b in candidates]
            best = max(range(len(scores)), key=scores.__getitem__)
            edges[a] = (scores[best], candidates[best])
    return edges


@pytest.mark.parametrize("length,chunk_size", [(40, 8), (37, 8), (64, 16), (9, 4)])
def test_matching_alternates_stays_in_chunk_and_takes_global_top(length, chunk_size):
    kv = random_kv(length=length)
    n_merge = length // 4
    src, dst = match_within_chunks(kv.keys, n_merge, chunk_size)
    for head in range(2):
        edges = brute_force_edges(kv.keys[0, head], chunk_size)
        chosen = src[0, head].tolist()
        assert all(a % 2 == 0 for a in chosen), "sources must be A (even) positions"
        assert all(b % 2 == 1 for b in dst[0, head].tolist()), "destinations must be B (odd) positions"
        assert all(a // chunk_size == b // chunk_size for a, b in zip(chosen, dst[0, head].tolist()))
        for a, b in zip(chosen, dst[0, head].tolist()):
            assert edges[a][1] == b, "each A merges into its most similar B"
        # global top-r: no unchosen edge beats the weakest chosen one
        weakest = min(edges[a][0] for a in chosen)
        assert all(score <= weakest + 1e-6 for a, (score, _) in edges.items() if a not in chosen)


def test_no_cross_chunk_match_even_when_better_outside():
    # Token 0 is identical to token 5 (another chunk of 4) and orthogonal-ish to its own B (1, 3).
    keys = torch.eye(8).repeat(1, 1, 1, 1)[:, :, :8, :]  # 8 orthonormal keys
    keys[0, 0, 5] = keys[0, 0, 0]
    src, dst = match_within_chunks(keys, 4, chunk_size=4)
    pairs = dict(zip(src[0, 0].tolist(), dst[0, 0].tolist()))
    assert pairs[0] in (1, 3)


def test_padding_slots_are_never_merged_even_if_all_edges_are_negative():
    # Keys alternate v, -v: every real A->B similarity is -1, a padding slot would score 0.
    direction = torch.randn(8)
    keys = torch.stack([direction if i % 2 == 0 else -direction for i in range(10)]).view(1, 1, 10, 8)
    kv = LayerKV(keys, keys.clone(), torch.zeros(1, 1, 10))
    src, dst = match_within_chunks(kv.keys, 5, chunk_size=8)
    assert src.max() < 10 and dst.max() < 10
    assert merge_tokens(kv, src, dst).length == 5


def test_weighted_merge_matches_hand_computation():
    # Tokens (degree): t0 (1), t1 (3), t2 (2), t3 (1). Merge t0 and t2 into t1.
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [5.0, 5.0]]).view(1, 1, 4, 2)
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0]]).view(1, 1, 4, 1)
    log_degree = torch.tensor([1.0, 3.0, 2.0, 1.0]).log().view(1, 1, 4)
    src, dst = torch.tensor([[[0, 2]]]), torch.tensor([[[1, 1]]])
    out = merge_tokens(LayerKV(keys, values, log_degree), src, dst)
    # key of the centroid: (1*[1,0] + 3*[0,1] + 2*[2,2]) / 6 = [5/6, 7/6]; value: (1 + 6 + 6) / 6 = 13/6
    torch.testing.assert_close(out.keys[0, 0], torch.tensor([[5 / 6, 7 / 6], [5.0, 5.0]]))
    torch.testing.assert_close(out.values[0, 0], torch.tensor([[13 / 6], [4.0]]))
    torch.testing.assert_close(out.log_degree[0, 0].exp(), torch.tensor([6.0, 1.0]))


def test_round_cannot_remove_more_than_half():
    kv = random_kv(length=20)
    with pytest.raises(ValueError, match="at most half"):
        match_within_chunks(kv.keys, 11, chunk_size=8)


def test_compress_runs_rounds_each_at_most_half_and_conserves_degree(monkeypatch):
    import centroidkv.csm as csm

    rounds = []
    real_merge = csm.Centroids.merge

    def recording_merge(centroids, src, dst):
        rounds.append((centroids.length, src.shape[-1]))
        return real_merge(centroids, src, dst)

    monkeypatch.setattr(csm.Centroids, "merge", recording_merge)
    schedule = LinearSchedule(r_init=0.9, delta_r=0.3, r_min=0.2)
    out = csm.csm_compress(random_kv(length=200), target_len=30, chunk_size=16, schedule=schedule)
    assert out.length == 30
    torch.testing.assert_close(out.log_degree.exp().sum(-1), torch.full((1, 2), 200.0))
    assert len(rounds) > 2, "reaching 15 % from 100 % needs several rounds"
    for j, (length, n_merge) in enumerate(rounds):
        assert n_merge <= length // 2
        assert n_merge == min(length - 30, max(1, int(schedule.rate(j) * (length // 2))))


@pytest.mark.parametrize(
    "r_init,delta_r,r_min", [(0.9, 0.25, 0.2), (1.0, 0.2, 0.3), (0.5, 0.0, 0.1), (0.3, 0.5, 0.05)]
)
def test_schedule_rates_stay_in_range_decrease_and_reach_the_budget(r_init, delta_r, r_min):
    """Behaviour, not the formula: every rate is in [r_min, 1], the rates never increase, and CSM
    driven by the schedule reaches a 10 % budget in a bounded number of rounds."""
    schedule = LinearSchedule(r_init=r_init, delta_r=delta_r, r_min=r_min)
    rates = [schedule.rate(j) for j in range(50)]
    assert all(r_min <= rate <= 1.0 for rate in rates)
    assert all(later <= earlier for earlier, later in zip(rates, rates[1:]))
    assert rates[0] == pytest.approx(min(1.0, r_init))
    if delta_r > 0:  # annealing ends at the floor
        assert rates[-1] == pytest.approx(r_min)
    out = csm_compress(random_kv(length=400), target_len=40, chunk_size=16, schedule=schedule)
    assert out.length == 40
    torch.testing.assert_close(out.log_degree.exp().sum(-1), torch.full((1, 2), 400.0))


def test_duplicate_pairs_merge_to_exact_attention():
    """Tokens repeated in pairs, merged 2 -> 1 with log 2, give the uncompressed attention output."""
    gen = torch.Generator().manual_seed(1)
    base_k, base_v = torch.randn(1, 2, 32, 16, generator=gen), torch.randn(1, 2, 32, 16, generator=gen)
    keys, values = base_k.repeat_interleave(2, dim=2), base_v.repeat_interleave(2, dim=2)
    kv = LayerKV(keys, values, torch.zeros(1, 2, 64))
    merged = csm_compress(kv, 32, chunk_size=16, schedule=LinearSchedule(1.0, 0.0, 1.0))
    assert merged.length == 32
    torch.testing.assert_close(merged.keys, base_k)
    torch.testing.assert_close(merged.log_degree, torch.full((1, 2, 32), math.log(2)))
    query = torch.randn(1, 2, 5, 16, generator=gen)
    full = F.scaled_dot_product_attention(query, keys, values)
    bias = merged.log_degree.unsqueeze(2)
    compressed = F.scaled_dot_product_attention(query, merged.keys, merged.values, attn_mask=bias)
    torch.testing.assert_close(compressed, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stays_finite_with_huge_degrees(dtype):
    kv = random_kv(length=64, dim=16)
    kv = LayerKV(kv.keys.to(dtype), kv.values.to(dtype), torch.full((1, 2, 64), math.log(1e5)))
    out = csm_compress(kv, 20, chunk_size=16, schedule=LinearSchedule(0.5, 0.1, 0.2))
    assert out.keys.dtype == dtype
    assert torch.isfinite(out.keys).all() and torch.isfinite(out.values).all()
    torch.testing.assert_close(out.log_degree.exp().sum(-1), torch.full((1, 2), 64 * 1e5), rtol=1e-5, atol=0)


# The reference: CSM as first written, every tensor (values included) merged and compacted round by
# round, and the matching keys of all entries recomputed every round.


def reference_merge(kv: LayerKV, src: torch.Tensor, dst: torch.Tensor) -> LayerKV:
    """Merge `src` into `dst` ([B, H, M]): x_b + sum_a w_a (x_a - x_b), w_a = n_a / (n_b + sum n_a), for
    keys, values and "mean" records; "sum" records add up; then keep the survivors, in order."""
    degree = kv.log_degree.float().exp()
    new_degree = degree.scatter_add(2, dst, degree.gather(2, src))
    weight = degree.gather(2, src) / new_degree.gather(2, dst)

    def average(x: torch.Tensor) -> torch.Tensor:  # x [B, H, T, D]
        def rows(positions):
            return positions.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])

        delta = (x.gather(2, rows(src)).float() - x.gather(2, rows(dst)).float()) * weight.unsqueeze(-1)
        return x.float().scatter_add(2, rows(dst), delta).to(x.dtype)

    extras = {
        name: average(record.unsqueeze(-1)).squeeze(-1)
        if merge_rule(name) == "mean"
        else record.scatter_add(2, dst, record.gather(2, src))
        for name, record in kv.extras.items()
    }
    merged = LayerKV(average(kv.keys), average(kv.values), new_degree.log(), extras)
    kept = torch.ones(kv.log_degree.shape, dtype=torch.bool).scatter(2, src, False)
    return merged.select(kept.nonzero()[:, 2].view(*kept.shape[:2], -1))


def reference_compress(kv, target_len, chunk_size, schedule, max_rounds=256, unit_match_keys=None):
    unit_match_keys = unit_match_keys or (lambda keys, records: unit_rows(keys))
    for round_idx in range(max_rounds):
        excess = kv.length - target_len
        if excess <= 0:
            return kv
        unit_keys = padded_rows(unit_match_keys(kv.keys, kv.extras), chunk_size)
        best_score, best_dst = chunk_edges(unit_keys, chunk_size, kv.length)
        n_merge = schedule.merge_count(round_idx, best_score, kv.length // 2, excess)
        kv = reference_merge(kv, *top_edges(best_score, best_dst, n_merge))
    raise RuntimeError("no convergence")


def test_pooled_values_equal_the_round_by_round_merge(monkeypatch):
    """Values (and records) pooled once from the tokens equal merging them every round: same
    entries, same degrees; the merges of each round are replayed on the reference."""
    import centroidkv.csm as csm

    gen = torch.Generator().manual_seed(3)
    batch, heads, length = 2, 3, 300
    kv = LayerKV(
        torch.randn(batch, heads, length, 16, generator=gen).cumsum(2) * 0.2,  # neighbours alike
        torch.randn(batch, heads, length, 16, generator=gen),
        torch.randint(1, 4, (batch, heads, length), generator=gen).float().log(),  # degrees 1 to 3
        {
            "position": torch.arange(length).float().expand(batch, heads, length).contiguous(),
            "attention_sum": torch.rand(batch, heads, length, generator=gen),
        },
    )
    rounds = []
    real_merge = csm.Centroids.merge

    def recording_merge(centroids, src, dst):
        rounds.append((src, dst))
        return real_merge(centroids, src, dst)

    monkeypatch.setattr(csm.Centroids, "merge", recording_merge)
    pooled = csm_compress(kv, 60, chunk_size=32, schedule=LinearSchedule(0.6, 0.1, 0.2))
    assert len(rounds) > 2
    expected = kv
    for src, dst in rounds:
        expected = reference_merge(expected, src, dst)
    degrees = pooled.log_degree.exp().round()  # integer degrees: the same members
    assert torch.equal(degrees, expected.log_degree.exp().round())
    assert degrees.max() > 5, "centroids of several rounds"
    torch.testing.assert_close(pooled.log_degree, expected.log_degree)
    torch.testing.assert_close(pooled.keys, expected.keys)
    torch.testing.assert_close(pooled.values, expected.values)
    for name in kv.extras:
        torch.testing.assert_close(pooled.extras[name], expected.extras[name])
    # ... and the matching is that of recomputing every entry's matching keys every round
    again = reference_compress(kv, 60, 32, LinearSchedule(0.6, 0.1, 0.2))
    assert torch.equal(again.log_degree.exp().round(), degrees)


def test_embedded_model_greedy_tokens_equal_the_reference_merging(embedded, monkeypatch):
    """SmolLM2-135M, a 1k-token essay prompt compressed to 25 % (pre-RoPE similarity, adaptive
    schedule): the kept entries and 24 greedy tokens equal those of the reference merging."""
    from eval.text import essay_text

    model, tokenizer = embedded
    ids = tokenizer(essay_text(900), return_tensors="pt").input_ids[:, :1000]
    assert ids.shape[1] == 1000
    method = get_method("centroidkv", heads="none")
    prefilled = prefill(model, ids, max_new_tokens=24, needs=method.needs())
    pooled_cache = prefilled.cache.fork(method, 0.25, 24)
    pooled = generate_from(model, prefilled, method, 0.25, 24)

    calls = []

    def reference(*args, **kwargs):
        calls.append(args[1])
        return reference_compress(*args, **kwargs)

    monkeypatch.setattr(centroidkv.centroidkv, "csm_compress", reference)
    expected_cache = prefilled.cache.fork(method, 0.25, 24)
    expected = generate_from(model, prefilled, method, 0.25, 24)
    assert len(calls) == 2 * model.config.num_hidden_layers  # the reference compressed every layer
    for ours, theirs in zip(pooled_cache.layers, expected_cache.layers, strict=True):
        assert torch.equal(ours.main.log_degree.exp().round(), theirs.main.log_degree.exp().round())
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)
    assert pooled.seq_lengths == expected.seq_lengths
    assert pooled.n_decode_steps == expected.n_decode_steps == 23
    assert pooled.tokens == expected.tokens
