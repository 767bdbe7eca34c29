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
would exceed `block_elements` (a memory bound, not an algorithmic loop).

Parameters:
  iterations: Lloyd iterations (default 10, the setting the paper's speed comparison quotes).
  stop_at_fixed_point: end early once an iteration changes no assignment (same result, less time;
    `scripts/bench_kmeans.py` turns it off to time all iterations as the paper does).
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

from centroidkv.methods import LayerKV, LayerStats, Method, check_int, register
from centroidkv.needs import pool_extras

INITS = ("uniform", "random")
BLOCK_ELEMENTS = 1 << 26


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


@register
@dataclass
class KMeans(Method):
    name = "kmeans"
    label = "K-Means"
    merges = True

    iterations: int = 10
    init: str = "uniform"
    seed: int = 0
    cosine: bool = True
    stop_at_fixed_point: bool = True

    def validate(self) -> None:
        super().validate()
        check_int(self, "iterations", minimum=1)
        check_int(self, "seed", minimum=0)
        if self.init not in INITS:
            raise ValueError(f"{self.name}: init must be one of {', '.join(INITS)}, got {self.init!r}")
        for flag in ("cosine", "stop_at_fixed_point"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{self.name}: {flag} must be True or False, got {getattr(self, flag)!r}")

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        seed = hash((self.seed, stats.layer_idx, kv.length)) % (2**63) if self.init == "random" else 0
        return kmeans_compress(
            kv, target_len, self.iterations, self.init, seed, self.cosine, self.stop_at_fixed_point
        )
