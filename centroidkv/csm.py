"""Chunked Soft Matching (CSM) and degree-weighted merging, as pure tensor functions.

From "Efficient Long-Context LLM Inference via KV Cache Clustering" (Hu et al., arXiv 2506.11418),
in the style of ToMe's bipartite soft matching. One round, per (batch, KV head):

1. split the sequence into chunks of `chunk_size` tokens; inside a chunk even positions form set A,
   odd positions set B (a shorter last chunk alternates the same way);
2. every A token finds its most cosine-similar B token *of the same chunk*;
3. the `n_merge` A->B edges with the highest similarity over the whole sequence are merged;
4. a B token and the A tokens merged into it become one centroid: the degree-weighted mean of keys
   and of values, with degree = the number of original tokens it stands for.

All heads of a layer merge the same number of tokens, so tensors stay rectangular. A round removes
at most half of the tokens (only A tokens disappear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from centroidkv.kv import LayerKV
from centroidkv.needs import merge_rule
from centroidkv.schedule import AdaptiveSchedule, LinearSchedule

Schedule = LinearSchedule | AdaptiveSchedule


def best_edges(keys: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Every A slot's best B partner in its chunk: (best cosine similarity, B position), [B, H, A].

    keys: [B, H, T, D]. A slot s sits at position 2 * s; there are ceil(T / 2) of them.
    """
    return chunk_edges(unit_rows(keys), chunk_size)


def unit_rows(keys: Tensor) -> Tensor:
    """Keys scaled to unit length, in float32 (dot products of unit keys are cosine similarities)."""
    return F.normalize(keys.float(), dim=-1).contiguous()  # eps 1e-12: a zero key stays zero


def chunk_edges(unit_keys: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """`best_edges` on keys already of unit length ([B, H, T, D] float32).

    The full chunks are one batched matmul on a view of the keys (no padded copy); a shorter last
    chunk alternates A/B the same way and is matched on its own. An A slot without any B partner
    (a last chunk of one token) scores -inf, so it is never merged. Cost O(T * chunk_size * D) per
    head instead of O(T^2 * D) for all pairs.
    """
    batch, heads, length, head_dim = unit_keys.shape
    half = chunk_size // 2
    n_full = length // chunk_size
    scores, partners = [], []
    if n_full:
        # chunk_size is even, so "even position inside the chunk" is "even position in the sequence"
        pairs = unit_keys[:, :, : n_full * chunk_size].view(batch, heads, n_full, half, 2, head_dim)
        similarity = pairs[..., 0, :] @ pairs[..., 1, :].transpose(-1, -2)  # [B, H, chunks, A, B]
        best_score, best_b = similarity.max(dim=-1)
        chunk_start = torch.arange(n_full, device=unit_keys.device).view(n_full, 1) * chunk_size
        scores.append(best_score.flatten(2))
        partners.append((chunk_start + 2 * best_b + 1).flatten(2))
    tail = unit_keys[:, :, n_full * chunk_size :]
    if tail.shape[2]:
        set_a, set_b = tail[:, :, 0::2], tail[:, :, 1::2]
        if set_b.shape[2]:
            best_score, best_b = (set_a @ set_b.transpose(-1, -2)).max(dim=-1)
        else:  # a lone A token: nothing to merge into
            best_score = set_a.new_full(set_a.shape[:3], float("-inf"))
            best_b = torch.zeros(set_a.shape[:3], dtype=torch.long, device=unit_keys.device)
        scores.append(best_score)
        partners.append(n_full * chunk_size + 2 * best_b + 1)
    return torch.cat(scores, dim=-1), torch.cat(partners, dim=-1)


def top_edges(best_score: Tensor, best_dst: Tensor, n_merge: int) -> tuple[Tensor, Tensor]:
    """The `n_merge` highest-scoring A->B edges of each head: (src, dst) positions, [B, H, n_merge]."""
    top_a = best_score.topk(n_merge, dim=-1).indices  # A slot ids
    return 2 * top_a, best_dst.gather(-1, top_a)


def match_within_chunks(keys: Tensor, n_merge: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Pick the `n_merge` best A->B edges; return their source and destination token indices.

    keys: [B, H, T, D]. Returns `src`, `dst`: [B, H, n_merge] int64 positions in the sequence.
    """
    if n_merge > keys.shape[2] // 2:
        raise ValueError(f"cannot merge {n_merge} of {keys.shape[2]} tokens in one round (at most half)")
    return top_edges(*best_edges(keys, chunk_size), n_merge)


class Centroids:
    """Entries being merged over several rounds, written in place instead of compacted every round.

    Keys, values (in their dtype), degrees and entry records (float32) are copied once into rows,
    (batch, head, token) flattened; `rows` [B, H, T] names the row holding each current entry (a
    centroid lives in the row of the B token it grew from). A merge updates only its destination
    rows and shortens `rows`; `current()` gathers the entries when they are needed. Each row's
    arithmetic is that of compacting the tensors every round, at a fraction of the memory traffic.
    """

    def __init__(self, kv: LayerKV):
        batch, heads, length = kv.log_degree.shape
        self.shape = (batch, heads)
        self.keys, self.values = _row_copy(kv.keys), _row_copy(kv.values)
        self.degree = kv.log_degree.float().exp().flatten()
        self.extras = {name: _row_copy(record.float()).squeeze(1) for name, record in kv.extras.items()}
        self.rows = torch.arange(batch * heads * length, device=kv.keys.device).view(batch, heads, length)

    @property
    def length(self) -> int:
        return self.rows.shape[2]

    def merge(self, src: Tensor, dst: Tensor) -> tuple[Tensor, Tensor]:
        """Merge the entries at positions `src` into those at `dst` ([B, H, M]) by degree-weighted means.

        x_b <- (n_b x_b + sum n_a x_a) / (n_b + sum n_a) for keys, values and "mean" records ("sum"
        records add up); n_b <- n_b + sum n_a. Written as x_b + sum_a w_a (x_a - x_b), with
        w_a = n_a / (n_b + sum n_a), in float32. Returns the positions kept ([B, H, T - M], in
        order) and where each destination now is ([B, H, M]).
        """
        src_row, dst_row = self.rows.gather(2, src).flatten(), self.rows.gather(2, dst).flatten()
        new_degree = self.degree.index_add(0, dst_row, self.degree[src_row])
        weight = (self.degree[src_row] / new_degree[dst_row]).unsqueeze(1)

        def average_into(rows: Tensor) -> None:
            delta = rows.index_select(0, src_row).float()
            delta.sub_(rows.index_select(0, dst_row).float()).mul_(weight)
            rows.index_add_(0, dst_row, delta.to(rows.dtype))

        average_into(self.keys)
        average_into(self.values)
        for name, record in self.extras.items():
            if merge_rule(name) == "mean":
                average_into(record.unsqueeze(1))
            else:  # e.g. a centroid has received the attention of all its members
                record.index_add_(0, dst_row, record[src_row])
        self.degree = new_degree
        is_src = torch.zeros(self.rows.shape, dtype=torch.bool, device=src.device).scatter_(2, src, True)
        survivors = (~is_src).nonzero()[:, 2].view(*self.shape, -1)  # every head keeps T - M
        self.rows = self.rows.gather(2, survivors)
        return survivors, (~is_src).cumsum(2).gather(2, dst) - 1

    def current(self) -> LayerKV:
        """The current entries as a LayerKV."""
        keys, records = self.keys_and_records()
        flat, shape = self.rows.flatten(), self.rows.shape
        values = self.values.index_select(0, flat).view(*shape, -1)
        return LayerKV(keys, values, self.degree[flat].log().view(shape), records)

    def keys_and_records(self, positions: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Keys [B, H, K, D] and entry records [B, H, K] of the entries at `positions` (default: all)."""
        rows = self.rows if positions is None else self.rows.gather(2, positions)
        flat, shape = rows.flatten(), rows.shape
        # index_select, not rows[index]: the advanced-indexing kernel is several times slower on a CPU
        keys = self.keys.index_select(0, flat).view(*shape, -1)
        return keys, {name: record[flat].view(shape) for name, record in self.extras.items()}


def merge_tokens(kv: LayerKV, src: Tensor, dst: Tensor) -> LayerKV:
    """One merge of the tokens at `src` into those at `dst` ([B, H, M]); the survivors keep their
    order. Degrees stay in float32, so half-precision caches handle degrees of 1e5 and more."""
    centroids = Centroids(kv)
    centroids.merge(src, dst)
    return centroids.current()


def csm_round(kv: LayerKV, n_merge: int, chunk_size: int) -> LayerKV:
    """One round of Chunked Soft Matching that removes exactly `n_merge` tokens."""
    src, dst = match_within_chunks(kv.keys, n_merge, chunk_size)
    return merge_tokens(kv, src, dst)


def csm_compress(
    kv: LayerKV,
    target_len: int,
    chunk_size: int,
    schedule: Schedule,
    max_rounds: int = 256,
    match_keys: Callable[[Tensor, dict[str, Tensor]], Tensor] | None = None,
) -> LayerKV:
    """Run rounds until `target_len` tokens remain; the schedule sets each round's merge count.

    `match_keys(keys, records)` gives the keys similarity is computed on, from entries' cached keys
    [B, H, K, D] and entry records [B, H, K] (default: the cached keys themselves); merging
    always averages the cached keys and values. The unit-length matching keys are computed once and
    then follow the merges: the survivors keep theirs and only each round's centroids are
    recomputed, which equals recomputing them all, at a fraction of the cost.
    """
    match_keys = match_keys or (lambda keys, records: keys)
    centroids = Centroids(kv)
    unit_keys = unit_rows(match_keys(kv.keys, kv.extras))
    for round_idx in range(max_rounds):
        excess = centroids.length - target_len
        if excess <= 0:
            return centroids.current()
        best_score, best_dst = chunk_edges(unit_keys, chunk_size)
        n_pairs = centroids.length // 2  # A tokens that have a B partner (at least)
        n_merge = schedule.merge_count(round_idx, best_score, n_pairs, excess)
        src, dst = top_edges(best_score, best_dst, n_merge)
        survivors, new_dst = centroids.merge(src, dst)
        unit_keys = take(unit_keys, survivors)  # the centroids' rows are then recomputed:
        index = new_dst.unsqueeze(-1).expand(-1, -1, -1, unit_keys.shape[-1])
        unit_keys.scatter_(2, index, unit_rows(match_keys(*centroids.keys_and_records(new_dst))))
    raise RuntimeError(f"CSM did not reach {target_len} tokens in {max_rounds} rounds")


def take(x: Tensor, positions: Tensor) -> Tensor:
    """x [B, H, T, D] at `positions` [B, H, K] -> [B, H, K, D] (a gather of whole rows)."""
    batch, heads, length, dim = x.shape
    offsets = (torch.arange(batch * heads, device=x.device) * length).view(batch, heads, 1)
    return x.reshape(-1, dim).index_select(0, (positions + offsets).flatten()).view(batch, heads, -1, dim)


def _row_copy(x: Tensor) -> Tensor:
    """A contiguous copy of x [B, H, T, (D)] as rows [B * H * T, D or 1], in one pass."""
    rows = x.new_empty(x.shape[:3].numel(), x.shape[3] if x.dim() == 4 else 1)
    rows.view(x.shape).copy_(x)
    return rows
