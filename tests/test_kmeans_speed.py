"""K-Means' incremental assignment gives bit for bit what scoring every centroid gave.

`baselines.kmeans` scores only the centroids that moved after the first Lloyd iteration. The
reference below is the implementation before that change: its assignment and Lloyd loop verbatim
(with its own BLOCK_ELEMENTS), the helpers the change left alone imported. Every kept entry must come
out identical: keys, values, log-degrees, order and pooled records.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from baselines import kmeans
from baselines.kmeans import cluster_sums, fill_empty_clusters, first_members, initial_seeds
from centroidkv.methods import LayerKV
from centroidkv.needs import pool_extras

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------ reference: before the incremental update

BLOCK_ELEMENTS = 1 << 26


def assign(points: Tensor, centroids: Tensor, cosine: bool) -> tuple[Tensor, Tensor]:
    """Nearest centroid of every point: (cluster [B, H, n], fitness [B, H, n], higher = closer)."""
    batch, heads, length, _ = points.shape
    block = max(1, BLOCK_ELEMENTS // max(1, batch * heads * centroids.shape[2]))
    clusters, fitness = [], []
    for start in range(0, length, block):  # bounds memory only; one block when it fits
        part = points[:, :, start : start + block]
        if cosine:
            score = part @ centroids.transpose(-1, -2)
        else:  # -||x - c||^2 up to the constant ||x||^2, which does not change the argmax
            score = 2 * part @ centroids.transpose(-1, -2) - centroids.square().sum(-1).unsqueeze(-2)
        best, index = score.max(dim=-1)
        clusters.append(index)
        fitness.append(best if cosine else best - part.square().sum(-1))
    return torch.cat(clusters, dim=-1), torch.cat(fitness, dim=-1)


def kmeans_compress(
    kv: LayerKV,
    k: int,
    iterations: int = 10,
    init: str = "uniform",
    seed: int = 0,
    cosine: bool = True,
    stop_at_fixed_point: bool = True,
) -> LayerKV:
    """Cluster the keys of `kv` into k degree-weighted centroids per (batch, KV head)."""
    batch, heads, length = kv.log_degree.shape
    degree = kv.log_degree.float().exp()
    points = F.normalize(kv.keys.float(), dim=-1) if cosine else kv.keys.float()
    seeds = initial_seeds(batch, heads, length, k, init, seed, kv.keys.device)
    centroids = points.gather(2, seeds.unsqueeze(-1).expand(-1, -1, -1, points.shape[-1]))
    previous = None
    for _ in range(iterations):
        cluster, fitness = assign(points, centroids, cosine)
        cluster = fill_empty_clusters(cluster, fitness, k)
        if stop_at_fixed_point and previous is not None and torch.equal(cluster, previous):
            break  # the centroids below would come out as they are: nothing changes any more
        previous = cluster
        sums = cluster_sums(points, cluster, degree, k)
        if cosine:
            centroids = F.normalize(sums, dim=-1)
        else:
            mass = torch.zeros(batch, heads, k, device=degree.device).scatter_add_(2, cluster, degree)
            centroids = sums / mass.unsqueeze(-1)

    total_degree = torch.zeros(batch, heads, k, device=degree.device).scatter_add_(2, cluster, degree)
    keys = cluster_sums(kv.keys, cluster, degree, k) / total_degree.unsqueeze(-1)
    values = cluster_sums(kv.values, cluster, degree, k) / total_degree.unsqueeze(-1)
    merged = LayerKV(
        keys.to(kv.keys.dtype),
        values.to(kv.values.dtype),
        total_degree.log().to(kv.log_degree.dtype),
        pool_extras(kv.extras, cluster, degree, k),
    )
    order = first_members(cluster, k).argsort(dim=-1)
    return merged.select(order)


# ------------------------------------------------------------------------------------------- helpers


def segment(batch: int, heads: int, length: int, dim: int, distinct: int | None, dtype, seed: int) -> LayerKV:
    """Random keys (drawn from `distinct` vectors when given: duplicates leave clusters empty),
    values, merged-looking log-degrees and an accumulated-attention record."""
    generator = torch.Generator().manual_seed(seed)
    if distinct is None:
        centres = torch.randn(batch, heads, length // 8, dim, generator=generator) * 3
        keys = centres[:, :, torch.randint(0, length // 8, (length,), generator=generator)]
        keys = keys + torch.randn(batch, heads, length, dim, generator=generator)
    else:
        pool = torch.randn(batch, heads, distinct, dim, generator=generator)
        keys = pool[:, :, torch.randint(0, distinct, (length,), generator=generator)]
    values = torch.randn(batch, heads, length, dim, generator=generator)
    log_degree = torch.rand(batch, heads, length, generator=generator).mul(2).log1p()
    attention = torch.rand(batch, heads, length, generator=generator)
    return LayerKV(keys.to(dtype), values.to(dtype), log_degree.to(dtype), {"attention_sum": attention})


def assert_identical(new: LayerKV, reference: LayerKV) -> None:
    for name in ("keys", "values", "log_degree"):
        assert torch.equal(getattr(new, name), getattr(reference, name)), name
    assert new.extras.keys() == reference.extras.keys()
    for name in reference.extras:
        assert torch.equal(new.extras[name], reference.extras[name]), name


@pytest.fixture
def product_shapes(monkeypatch) -> list[tuple[int, int]]:
    """(points, centroids) of every similarity product `baselines.kmeans` computes."""
    shapes = []
    nearest = kmeans.nearest

    def spy(points, centroids, cosine, block=None):
        shapes.append((points.shape[2], centroids.shape[2]))
        return nearest(points, centroids, cosine, block)

    monkeypatch.setattr(kmeans, "nearest", spy)
    return shapes


# --------------------------------------------------------------------------------------------- tests

CASES = [  # batch, heads, length, dim, k, distinct keys (None: noisy groups), dtype
    (1, 3, 900, 64, 250, None, torch.float32),
    (2, 2, 700, 16, 300, None, torch.float32),
    (1, 2, 600, 32, 150, 40, torch.float32),  # 40 distinct keys for 150 clusters: empty clusters
    (1, 2, 500, 32, 120, None, torch.bfloat16),
    (1, 1, 40, 8, 12, None, torch.float32),  # too small for partial products: all scored
]


@pytest.mark.parametrize("slice_rows", [None, 100], ids=["one-product", "cache-slices"])
@pytest.mark.parametrize("cosine", [True, False], ids=["cosine", "euclidean"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: "x".join(map(str, case[:6])))
def test_kmeans_is_bitwise_the_reference(case, cosine, slice_rows, product_shapes, monkeypatch):
    batch, heads, length, dim, k, distinct, dtype = case
    if slice_rows:  # the scores in slices of ~100 points, as the CPU default does at 4k tokens
        monkeypatch.setattr(kmeans, "CACHE_ELEMENTS", batch * heads * k * slice_rows)
    for init, seed in (("uniform", 0), ("random", 3)):
        kv = segment(batch, heads, length, dim, distinct, dtype, seed=seed)
        reference = kmeans_compress(kv, k, iterations=12, init=init, seed=seed, cosine=cosine)
        assert_identical(
            kmeans.kmeans_compress(kv, k, iterations=12, init=init, seed=seed, cosine=cosine), reference
        )
    if distinct is None and length >= 500:  # the later iterations scored a part only
        assert any(shape != (length, k) for shape in product_shapes)


def test_kmeans_with_empty_clusters_is_bitwise_the_reference():
    """Ten distinct keys for 200 clusters: most clusters are refilled after every assignment."""
    kv = segment(1, 2, 800, 16, 10, torch.float32, seed=5)
    for cosine in (True, False):
        assert_identical(
            kmeans.kmeans_compress(kv, 200, cosine=cosine), kmeans_compress(kv, 200, cosine=cosine)
        )


@pytest.mark.parametrize("block", [300, 333])
def test_kmeans_in_blocks_is_bitwise_the_reference(monkeypatch, block):
    """1000 points in blocks of 300 (a tail of 100) or 333 (a tail of one point, which MKL scores
    with another kernel: partial products would differ, so every iteration scores all)."""
    block_elements = 2 * 120 * block  # batch * heads * k * points per block
    monkeypatch.setattr(kmeans, "BLOCK_ELEMENTS", block_elements)
    monkeypatch.setitem(globals(), "BLOCK_ELEMENTS", block_elements)  # the reference's
    kv = segment(1, 2, 1000, 32, None, torch.float32, seed=7)
    for cosine in (True, False):
        assert_identical(
            kmeans.kmeans_compress(kv, 120, cosine=cosine), kmeans_compress(kv, 120, cosine=cosine)
        )


def test_kmeans_without_shortcuts_is_bitwise_the_reference_and_scores_everything(product_shapes):
    """stop_at_fixed_point=False: all iterations, each scoring every centroid, as the paper times it."""
    kv = segment(1, 3, 600, 32, None, torch.float32, seed=11)
    for cosine in (True, False):
        new = kmeans.kmeans_compress(kv, 200, iterations=15, cosine=cosine, stop_at_fixed_point=False)
        assert_identical(
            new, kmeans_compress(kv, 200, iterations=15, cosine=cosine, stop_at_fixed_point=False)
        )
    assert product_shapes == [(600, 200)] * 30


@pytest.mark.parametrize("cosine", [True, False], ids=["cosine", "euclidean"])
def test_update_nearest_keeps_ties_at_the_lowest_index(cosine, product_shapes):
    """Centroids in identical pairs, points on centroids: every point ties between two centroids.
    Moving either one of a pair (or none) must give what scoring everything gives."""
    generator = torch.Generator().manual_seed(0)
    half = torch.randn(1, 2, 100, 16, generator=generator)
    old = torch.cat([half, half], dim=2)[:, :, torch.randperm(200, generator=generator)]  # [1, 2, 200, 16]
    points = torch.cat([old, torch.randn(1, 2, 600, 16, generator=generator)], dim=2)
    if cosine:
        old, points = F.normalize(old, dim=-1), F.normalize(points, dim=-1)
    best, index = kmeans.nearest(points, old, cosine)
    # move 30 centroids onto copies of other centroids (new ties both ways) and 30 elsewhere
    new = old.clone()
    targets = torch.randperm(200, generator=generator)
    new[:, :, targets[:30]] = old[:, :, targets[30:60]]
    new[:, :, targets[60:90]] = F.normalize(torch.randn(1, 2, 30, 16, generator=generator), dim=-1)
    moved = (new != old).any(dim=-1)
    expected = kmeans.nearest(points, new, cosine)
    del product_shapes[:]
    got = kmeans.update_nearest(points, new, moved, best, index, cosine)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert (800, 200) not in product_shapes  # a partial update, not all scored again


@pytest.mark.parametrize("cosine", [True, False], ids=["cosine", "euclidean"])
def test_update_nearest_keeps_the_bits_of_one_and_two_point_products(cosine, monkeypatch):
    """MKL multiplies one or two rows with another kernel, which rounds differently: a point that
    `nearest` scores in a block of its own, or a handful of points that lost their centroid, must
    still get the same bits (best scores compared, not only the argmax)."""
    generator = torch.Generator().manual_seed(1)
    points = torch.randn(2, 2, 601, 32, generator=generator)
    old = torch.randn(2, 2, 100, 32, generator=generator)
    if cosine:
        points, old = F.normalize(points, dim=-1), F.normalize(old, dim=-1)

    def check(moved: Tensor) -> None:
        new = torch.where(moved.unsqueeze(-1), old + 0.1, old)
        best, index = kmeans.nearest(points, old, cosine)
        got = kmeans.update_nearest(points, new, moved, best, index, cosine)
        expected = kmeans.nearest(points, new, cosine)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    _, index = kmeans.nearest(points, old, cosine)
    members = torch.zeros(2, 2, 100, dtype=torch.long).scatter_add_(2, index, torch.ones_like(index))
    rarest = members.masked_fill(members == 0, 10**6).argmin(dim=-1, keepdim=True)  # 1 or 2 members
    check(torch.zeros(2, 2, 100, dtype=torch.bool).scatter(2, rarest, True))
    monkeypatch.setattr(kmeans, "BLOCK_ELEMENTS", 2 * 2 * 100 * 300)  # blocks of 300, 300 and 1 point
    last_point_centroid = index[:, :, -1:]
    check(torch.zeros(2, 2, 100, dtype=torch.bool).scatter(2, last_point_centroid, True))


@pytest.mark.parametrize("cosine", [True, False], ids=["cosine", "euclidean"])
def test_cache_slices_give_the_bits_of_one_product(cosine, monkeypatch):
    """On a CPU `nearest` scores cache-sized slices of points (at least MIN_SUBSET rows each, a short
    tail joins the slice before it): best scores and indices equal one product of all points."""
    generator = torch.Generator().manual_seed(2)
    points = torch.randn(1, 3, 1000, 64, generator=generator)
    centroids = points[:, :, ::4] + 0.1 * torch.randn(1, 3, 250, 64, generator=generator)
    if cosine:
        points, centroids = F.normalize(points, dim=-1), F.normalize(centroids, dim=-1)
    cluster, fitness = assign(points, centroids, cosine)  # the reference: one product of all points
    monkeypatch.setattr(kmeans, "CACHE_ELEMENTS", 3 * 250 * 70)  # slices of 70-71 rows
    assert [part.shape[2] for part in kmeans.cache_slices(points, 250)][-1] >= 70
    assert len(kmeans.cache_slices(points, 250)) == 1000 // 70
    best, index = kmeans.nearest(points, centroids, cosine)
    assert torch.equal(index, cluster)
    assert torch.equal(best if cosine else best - points.square().sum(-1), fitness)
