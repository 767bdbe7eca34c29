"""K-Means: the clustering baseline of the CentroidKV paper.

Paper: Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering" (arXiv
2506.11418) compares its Chunked Soft Matching with plain K-Means clustering of the keys, which
costs O(iterations * n * k * d) per head instead of O(n * c * d). Only the clustering differs from
CentroidKV: the same centroid machinery (degree-weighted means of keys and values, log-degree
attention) turns each cluster into one entry.

Per (batch, KV head), on the keys of the mergeable middle, k = target_len clusters:
1. init: "uniform" takes k evenly spaced tokens as seeds (deterministic, follows the sequence,
   like CSM's locality); "random" takes k distinct random tokens (torch generator seeded by `seed`,
   the layer and the segment length, so runs are reproducible).
2. Lloyd iterations: assign every token to its most similar centroid, then move each centroid to
   the degree-weighted mean of its members. An iteration that changes no assignment is a fixed
   point (the same members give the same centroids, hence the same assignment again), so with
   `stop_at_fixed_point` the loop ends there: the result is identical to running all iterations.
   On SmolLM2's keys at 4k this happens after 1-3 iterations. With `cosine=True` (default, the similarity CSM uses)
   this is spherical K-Means on unit-normalised keys; with `cosine=False` Euclidean K-Means on the
   raw keys.
3. Empty clusters are re-seeded after every assignment with the worst-fitting tokens (lowest
   similarity to their centroid), never taking the first member of a cluster, so every cluster is
   non-empty and exactly k entries come out.
4. Output entries: degree-weighted means of the raw keys and values of each cluster,
   log_degree = log(sum of degrees), accumulated attention summed; ordered by first member.

The assignment is computed in blocks of tokens when the [n, k] similarity matrix of all heads
would exceed `BLOCK_ELEMENTS` (a memory bound, not an algorithmic loop), and on a CPU each block in
slices of `CACHE_ELEMENTS` scores, whose row maxima are then read from the cache (`cache_slices`).

After the first iteration only the centroids that moved are scored again (`update_nearest`): an
unmoved centroid (bitwise the same) keeps its similarities, so a token's best centroid can only
change to a moved one, or to any centroid when its own moved. On SmolLM2 at 4k the second
iteration moves most centroids and the later ones a few percent, so this cuts the similarity
products of a compression to about 2-3 full ones. The result is the same bit for bit as long as
one similarity does not depend on the other rows and columns of its matrix product. MKL on CPU
behaves so from 3 rows on (1 or 2 rows take another kernel that rounds differently, hence
`MIN_SUBSET`; tests/test_kmeans_speed.py checks it against the plain implementation); GPU
libraries choose kernels by shape, so on a GPU every iteration scores all centroids, and so
does every iteration with `stop_at_fixed_point=False`.

Parameters:
  iterations: Lloyd iterations (default 10, the setting the paper's speed comparison quotes).
  stop_at_fixed_point: skip the work that cannot change the result: end once an iteration changes
    no assignment, and rescore only the centroids that moved (same result, less time). False runs
    every iteration in full, as the paper times it (`scripts/bench_kmeans.py`).
  init: "uniform" or "random".
  seed: seed of the "random" init.
  cosine: spherical (True) or Euclidean (False) K-Means.
  n_sink, n_recent, compress_interval: as CentroidKV (16, 64, 64), same protected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from centroidkv.methods import LayerKV, LayerStats, Method, param, register
from centroidkv.needs import pool_extras

INITS = ("uniform", "random")
BLOCK_ELEMENTS = 1 << 26
MIN_SUBSET = 64  # rows and columns of the smallest partial product (see the module docstring)
# On a CPU a block's scores are computed in slices of about this many elements (4 MiB), so that the
# row maxima read them while they are still in the cache instead of from memory: ~1.5x faster.
CACHE_ELEMENTS = 1 << 20


def initial_seeds(batch: int, heads: int, length: int, k: int, init: str, seed: int, device) -> Tensor:
    """[B, H, k] token indices of the initial centroids."""
    if init == "uniform":
        index = torch.linspace(0, length - 1, k, device=device).round().long()
        return index.expand(batch, heads, k)
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.rand(batch, heads, length, generator=generator)
        .argsort(dim=-1)[..., :k]
        .sort(-1)
        .values.to(device)
    )


def scores(points: Tensor, centroids: Tensor, cosine: bool) -> Tensor:
    """[B, H, n, k] similarity of every point to every centroid (higher = closer)."""
    if cosine:
        return points @ centroids.transpose(-1, -2)
    # -||x - c||^2 up to the constant ||x||^2, which does not change the argmax
    return 2 * points @ centroids.transpose(-1, -2) - centroids.square().sum(-1).unsqueeze(-2)


def row_block(points: Tensor, n_centroids: int) -> int:
    """Points per block of the similarity matrix (all of them when it fits in `BLOCK_ELEMENTS`)."""
    batch, heads = points.shape[:2]
    return max(1, BLOCK_ELEMENTS // max(1, batch * heads * n_centroids))


def nearest(
    points: Tensor, centroids: Tensor, cosine: bool, block: int | None = None
) -> tuple[Tensor, Tensor]:
    """Most similar centroid of every point: (best score [B, H, n], its centroid [B, H, n]); ties
    go to the lowest centroid index. `block`: points per matrix product (default: `row_block`)."""
    block = block or row_block(points, centroids.shape[2])
    best, index = [], []
    for start in range(0, points.shape[2], block):  # bounds memory only; one block when it fits
        for part in cache_slices(points[:, :, start : start + block], centroids.shape[2]):
            part_best, part_index = scores(part, centroids, cosine).max(dim=-1)
            best.append(part_best)
            index.append(part_index)
    return torch.cat(best, dim=-1), torch.cat(index, dim=-1)


def cache_slices(points: Tensor, n_centroids: int) -> tuple[Tensor, ...]:
    """`points` [B, H, n, D] cut along n into slices whose scores hold about `CACHE_ELEMENTS`, on a
    CPU only. Every slice keeps at least `MIN_SUBSET` rows, so each score is the bits one product of
    all rows gives (see the module docstring); on a GPU the block stays whole."""
    batch, heads, length = points.shape[:3]
    if points.device.type != "cpu":
        return (points,)
    rows = max(MIN_SUBSET, CACHE_ELEMENTS // max(1, batch * heads * n_centroids))
    return points.tensor_split(max(1, length // rows), dim=2)  # slices of >= `rows` rows


def first_true(mask: Tensor, count: int) -> Tensor:
    """[B, H, count] indices along the last dim: those where `mask` holds first (ascending), then
    the others (ascending) to fill up to `count`."""
    return mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :count]


def update_nearest(
    points: Tensor, centroids: Tensor, moved: Tensor, best: Tensor, index: Tensor, cosine: bool
) -> tuple[Tensor, Tensor]:
    """`nearest(points, centroids)` from the previous iteration's (best, index), scoring only what
    the centroids that `moved` ([B, H, k], bool) can change; the result is bitwise the same.

    Every point is scored against the moved centroids (an unmoved one keeps its score, so the old
    best stands unless a moved centroid beats or ties it at a lower index), and the points whose
    own centroid moved against all centroids. Subsets are padded with other centroids or points,
    which changes nothing: an unmoved centroid never beats the old best, a point scored against
    all centroids gets its true nearest. Every product keeps at least `MIN_SUBSET` rows, or the
    rows `nearest` gives it, so that each score comes from the same kernel as in `nearest`.
    """
    length, k = points.shape[2], centroids.shape[2]
    block = row_block(points, k)
    if block < MIN_SUBSET or 0 < length % block < MIN_SUBSET:  # `nearest` has a short block
        return nearest(points, centroids, cosine)
    n_columns = max(int(moved.sum(dim=-1).max()), MIN_SUBSET)
    lost = moved.gather(2, index)  # the point's own centroid moved: its old best is gone
    n_rows = max(int(lost.sum(dim=-1).max()), MIN_SUBSET)
    if n_rows > block:  # whole blocks only
        n_rows = -(-n_rows // block) * block
    if length * n_columns + n_rows * k >= length * k:  # nothing to save
        return nearest(points, centroids, cosine)

    columns = first_true(moved, n_columns)  # [B, H, c] moved centroids first
    picked = centroids.gather(2, columns.unsqueeze(-1).expand(-1, -1, -1, centroids.shape[-1]))
    moved_best, moved_at = nearest(points, picked, cosine, block)
    moved_index = columns.gather(2, moved_at)
    rows = first_true(lost, n_rows)  # [B, H, r] points that lost their centroid first
    picked_points = points.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, points.shape[-1]))
    row_best, row_index = nearest(picked_points, centroids, cosine, block)
    if bool(moved_best.isnan().any() | row_best.isnan().any()):  # max() propagates NaN: score all
        return nearest(points, centroids, cosine)

    beaten = moved_best > best
    tied = moved_best == best
    index = torch.where(beaten, moved_index, torch.where(tied, torch.minimum(moved_index, index), index))
    best = torch.where(beaten, moved_best, best)
    return best.scatter(2, rows, row_best), index.scatter(2, rows, row_index)


def first_members(cluster: Tensor, k: int) -> Tensor:
    """[B, H, k] earliest token of each cluster (`length` for an empty one)."""
    length = cluster.shape[-1]
    position = torch.arange(length, device=cluster.device).expand_as(cluster)
    first = torch.full((*cluster.shape[:2], k), length, device=cluster.device, dtype=torch.long)
    return first.scatter_reduce(2, cluster, position, reduce="amin")


def fill_empty_clusters(cluster: Tensor, fitness: Tensor, k: int) -> Tensor:
    """Give every empty cluster one of the worst-fitting tokens that is not a cluster's first member.

    There are always enough donors: n - (non-empty clusters) >= number of empty clusters as n >= k.
    """
    length = cluster.shape[-1]
    first = first_members(cluster, k)
    empty = first == length  # [B, H, k]
    if not bool(empty.any()):
        return cluster
    position = torch.arange(length, device=cluster.device)
    is_first = first.gather(2, cluster) == position  # token i is the first member of its own cluster
    donors = fitness.masked_fill(is_first, torch.inf).argsort(dim=-1, stable=True)[..., :k]  # worst first
    empty_ids = empty.to(torch.int8).argsort(dim=-1, descending=True, stable=True)  # empty clusters first
    n_empty = empty.sum(dim=-1, keepdim=True)
    use = torch.arange(k, device=cluster.device) < n_empty  # [B, H, k]
    new_cluster = torch.where(use, empty_ids, cluster.gather(2, donors))
    return cluster.scatter(2, donors, new_cluster)


def cluster_sums(x: Tensor, cluster: Tensor, weight: Tensor, k: int) -> Tensor:
    """[B, H, k, D]: sum of weight * x over the members of each cluster (float32)."""
    total = x.new_zeros((*x.shape[:2], k, x.shape[-1]), dtype=torch.float32)
    index = cluster.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])
    return total.scatter_add_(2, index, x.float() * weight.unsqueeze(-1))


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
    squared_norm = None if cosine else points.square().sum(-1)
    rescore_moved_only = stop_at_fixed_point and points.device.type == "cpu"
    previous = moved = None
    for _ in range(iterations):
        if moved is None or not rescore_moved_only:
            best, index = nearest(points, centroids, cosine)
        else:
            best, index = update_nearest(points, centroids, moved, best, index, cosine)
        fitness = best if cosine else best - squared_norm
        cluster = fill_empty_clusters(index, fitness, k)
        if stop_at_fixed_point and previous is not None and torch.equal(cluster, previous):
            break  # the centroids below would come out as they are: nothing changes any more
        previous = cluster
        sums = cluster_sums(points, cluster, degree, k)
        if cosine:
            moved_to = F.normalize(sums, dim=-1)
        else:
            mass = torch.zeros(batch, heads, k, device=degree.device).scatter_add_(2, cluster, degree)
            moved_to = sums / mass.unsqueeze(-1)
        moved = (moved_to.view(torch.int32) != centroids.view(torch.int32)).any(dim=-1)  # bits, not values
        centroids = moved_to

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


@register
@dataclass
class KMeans(Method):
    name = "kmeans"
    label = "K-Means"
    merges = True

    iterations: int = param(10, minimum=1)
    init: str = param("uniform", choices=INITS)
    seed: int = param(0, minimum=0)
    cosine: bool = True  # a bool: checked as one (centroidkv.params)
    stop_at_fixed_point: bool = True

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        seed = hash((self.seed, stats.layer_idx, kv.length)) % (2**63) if self.init == "random" else 0
        return kmeans_compress(
            kv, target_len, self.iterations, self.init, seed, self.cosine, self.stop_at_fixed_point
        )
