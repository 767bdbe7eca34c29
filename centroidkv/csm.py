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

import math
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
    length = keys.shape[2]
    return chunk_edges(padded_rows(unit_rows(keys), chunk_size), chunk_size, length)


def unit_rows(keys: Tensor) -> Tensor:
    """Keys scaled to unit length, in float32 (dot products of unit keys are cosine similarities)."""
    return F.normalize(keys.float(), dim=-1).contiguous()  # eps 1e-12: a zero key stays zero


def padded_rows(rows: Tensor, chunk_size: int, out: Tensor | None = None) -> Tensor:
    """rows [B, H, T, D] in a contiguous [B, H, P, D], P = T rounded up to whole chunks (see
    `chunk_edges`); itself when T already is a whole number of chunks and no `out` is given."""
    if out is None and rows.shape[2] % chunk_size == 0 and rows.is_contiguous():
        return rows
    positions = torch.arange(rows.shape[2], device=rows.device).expand(rows.shape[:3])
    return compact(rows, positions, chunk_size, out)


def compact(rows: Tensor, positions: Tensor, chunk_size: int, out: Tensor | None = None) -> Tensor:
    """rows [B, H, P, D] at `positions` [B, H, K], in order, padded to whole chunks: [B, H, Q, D] with
    Q = K rounded up to a multiple of `chunk_size`; a padding row repeats its head's first row, so it
    is finite. One gather of whole rows, written at the start of `out`'s storage when given (a buffer
    reused across rounds: a fresh allocation of this size costs more than the copy itself)."""
    batch, heads, length, dim = rows.shape
    kept = positions.shape[2]
    index = F.pad(positions, (0, -kept % chunk_size))  # padding rows: position 0
    flat = _flat_rows(index, length)
    if out is None:
        target = rows.new_empty(flat.numel(), dim)
    else:
        target = out.view(-1)[: flat.numel() * dim].view(-1, dim)
    torch.index_select(rows.reshape(-1, dim), 0, flat, out=target)
    return target.view(batch, heads, -1, dim)


def chunk_edges(
    unit_keys: Tensor, chunk_size: int, length: int | None = None, workspace: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`best_edges` on keys already of unit length and padded to whole chunks.

    unit_keys: [B, H, P, D] float32, contiguous, P a multiple of `chunk_size`; the entries are the
    first `length` rows (default: all), later rows are padding (finite), never matched. All chunks
    are one batched matmul on a view of the keys, with the similarity matrices written into
    `workspace` (grown as needed; reused across rounds) when given. A slot without any B partner
    (a last chunk of one token) scores -inf, so it is never merged. Cost O(T * chunk_size * D) per
    head instead of O(T^2 * D) for all pairs.
    """
    batch, heads, padded, head_dim = unit_keys.shape
    length = padded if length is None else length
    half = chunk_size // 2
    n_chunks = padded // chunk_size
    # chunk_size is even, so "even position inside the chunk" is "even position in the sequence"
    pairs = unit_keys.view(batch * heads * n_chunks, half, 2, head_dim)
    shape = (batch * heads * n_chunks, half, half)
    if workspace is None:
        similarity = unit_keys.new_empty(shape)
    else:
        if workspace.numel() < math.prod(shape):
            workspace.resize_(math.prod(shape))
        similarity = workspace[: math.prod(shape)].view(shape)
    torch.bmm(pairs[:, :, 0], pairs[:, :, 1].transpose(1, 2), out=similarity)  # [., A, B]
    last_start = (n_chunks - 1) * chunk_size
    similarity.view(batch * heads, n_chunks, half, half)[:, -1, :, (length - last_start) // 2 :] = -torch.inf
    best_score, best_b = similarity.max(dim=-1)
    chunk_start = torch.arange(n_chunks, device=unit_keys.device).view(n_chunks, 1) * chunk_size
    partners = (chunk_start + 2 * best_b.view(batch, heads, n_chunks, half) + 1).view(batch, heads, -1)
    n_slots = (length + 1) // 2
    return best_score.view(batch, heads, -1)[..., :n_slots], partners[..., :n_slots]


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

    Keys (float32), degrees and entry records are copied once into rows, (batch, head, token)
    flattened; `rows` [B, H, L] names the row holding each current entry (a centroid lives in the row
    of the B token it grew from). A merge updates only its destination rows and shortens `rows`.
    Values are not merged round by round: `entry_of_token` [B, H, T] follows every original token to
    the entry holding it, and `current()` pools each entry's value once, sum(d_i v_i) / sum(d_i) over
    its members i -- what merging them round by round gives, without moving values every round.
    """

    def __init__(self, kv: LayerKV):
        batch, heads, length = kv.log_degree.shape
        self.kv = kv
        self.keys = _row_copy(kv.keys, torch.float32)
        self.degree = kv.log_degree.float().exp().flatten()
        self.extras = {
            name: _row_copy(record, torch.float32).squeeze(1) for name, record in kv.extras.items()
        }
        self.rows = torch.arange(batch * heads * length, device=kv.keys.device).view(batch, heads, length)
        self.entry_of_token = torch.arange(length, device=kv.keys.device).expand(batch, heads, length)

    @property
    def length(self) -> int:
        return self.rows.shape[2]

    def merge(self, src: Tensor, dst: Tensor) -> tuple[Tensor, Tensor]:
        """Merge the entries at positions `src` into those at `dst` ([B, H, M]) by degree-weighted means.

        k_b <- (n_b k_b + sum n_a k_a) / (n_b + sum n_a) for keys and "mean" records ("sum" records
        add up); n_b <- n_b + sum n_a. Written as k_b + sum_a w_a (k_a - k_b), with
        w_a = n_a / (n_b + sum n_a), in float32. Returns the positions kept ([B, H, L - M], in
        order) and where each destination now is ([B, H, M]).
        """
        src_row, dst_row = self.rows.gather(2, src).flatten(), self.rows.gather(2, dst).flatten()
        new_degree = self.degree.index_add(0, dst_row, self.degree[src_row])
        weight = (self.degree[src_row] / new_degree[dst_row]).unsqueeze(1)

        def average_into(rows: Tensor) -> None:
            delta = rows.index_select(0, src_row)
            delta.sub_(rows.index_select(0, dst_row)).mul_(weight)
            rows.index_add_(0, dst_row, delta)

        average_into(self.keys)
        for name, record in self.extras.items():
            if merge_rule(name) == "mean":
                average_into(record.unsqueeze(1))
            else:  # e.g. a centroid has received the attention of all its members
                record.index_add_(0, dst_row, record[src_row])
        self.degree = new_degree
        kept = torch.ones(self.rows.shape, dtype=torch.bool, device=src.device).scatter_(2, src, False)
        survivors = kept.nonzero()[:, 2].view(*self.shape, -1)  # every head keeps L - M
        self.rows = self.rows.gather(2, survivors)
        # old position -> new one: a survivor's rank among the survivors, a source its destination's
        new_position = kept.cumsum(2).sub_(1)
        new_dst = new_position.gather(2, dst)
        new_position.scatter_(2, src, new_dst)
        self.entry_of_token = new_position.gather(2, self.entry_of_token)
        return survivors, new_dst

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape[:2])

    def current(self) -> LayerKV:
        """The current entries as a LayerKV; values pooled from the original tokens."""
        keys, records = self.keys_and_records()
        degree = self.degree[self.rows.flatten()]
        values = pool_rows(self.kv.values, self.kv.log_degree, self.entry_of_token, degree)
        return LayerKV(keys.to(self.kv.keys.dtype), values, degree.log().view(self.rows.shape), records)

    def keys_and_records(self, positions: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Keys [B, H, K, D] (float32) and entry records [B, H, K] of the entries at `positions`
        (default: all)."""
        rows = self.rows if positions is None else self.rows.gather(2, positions)
        flat, shape = rows.flatten(), rows.shape
        # index_select, not rows[index]: the advanced-indexing kernel is several times slower on a CPU
        keys = self.keys.index_select(0, flat).view(*shape, -1)
        return keys, {name: record[flat].view(shape) for name, record in self.extras.items()}


def pool_rows(rows: Tensor, log_degree: Tensor, entry_of_token: Tensor, entry_degree: Tensor) -> Tensor:
    """Degree-weighted means of token rows per entry: rows [B, H, T, D] with degrees exp(log_degree)
    [B, H, T], `entry_of_token` [B, H, T] in [0, K), `entry_degree` [B * H * K] (the sum of its
    tokens' degrees) -> [B, H, K, D] in the rows' dtype, one pass over the tokens in float32."""
    batch, heads, length, dim = rows.shape
    n_entries = entry_degree.numel() // (batch * heads)
    offsets = torch.arange(batch * heads, device=rows.device).view(batch, heads, 1) * n_entries
    source = rows.float().reshape(-1, dim)  # a view when the rows already are float32 and contiguous
    if log_degree.any():  # original tokens (degree 1, the prefill case) need no weighting
        source = source * log_degree.float().exp().reshape(-1, 1)
    sums = source.new_zeros(batch * heads * n_entries, dim)
    sums.index_add_(0, (entry_of_token + offsets).flatten(), source)
    return sums.div_(entry_degree.unsqueeze(1)).view(batch, heads, n_entries, dim).to(rows.dtype)


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
    unit_match_keys: Callable[[Tensor, dict[str, Tensor]], Tensor] | None = None,
) -> LayerKV:
    """Run rounds until `target_len` tokens remain; the schedule sets each round's merge count.

    `unit_match_keys(keys, records)` gives the unit-length float32 keys similarity is computed on,
    from entries' cached keys [B, H, K, D] and entry records [B, H, K] (default: the cached keys
    scaled to unit length), as a new tensor (it becomes a work buffer); merging always averages the
    cached keys and values. The matching keys are computed once and then follow the merges: the
    survivors keep theirs and only each round's centroids are recomputed, which equals recomputing
    them all, at a fraction of the cost. Each round compacts them into the other of two buffers, so
    no round allocates a full-size tensor; values are pooled once at the end (`Centroids`).
    """
    unit_match_keys = unit_match_keys or (lambda keys, records: unit_rows(keys))
    centroids = Centroids(kv)
    unit_keys = padded_rows(unit_match_keys(kv.keys, kv.extras), chunk_size)
    spare = torch.empty_like(unit_keys)  # the other buffer; its pages are only mapped once written
    workspace = unit_keys.new_empty(0)
    for round_idx in range(max_rounds):
        excess = centroids.length - target_len
        if excess <= 0:
            return centroids.current()
        best_score, best_dst = chunk_edges(unit_keys, chunk_size, centroids.length, workspace)
        n_pairs = centroids.length // 2  # A tokens that have a B partner (at least)
        n_merge = schedule.merge_count(round_idx, best_score, n_pairs, excess)
        src, dst = top_edges(best_score, best_dst, n_merge)
        survivors, new_dst = centroids.merge(src, dst)
        if centroids.length > target_len:  # another round will match on these keys
            unit_keys, spare = compact(unit_keys, survivors, chunk_size, out=spare), unit_keys
            put(unit_keys, new_dst, unit_match_keys(*centroids.keys_and_records(new_dst)))
    raise RuntimeError(f"CSM did not reach {target_len} tokens in {max_rounds} rounds")


def _flat_rows(positions: Tensor, length: int) -> Tensor:
    """Positions [B, H, K] along a sequence of `length` -> row numbers of the (batch, head, token)
    flattening, [B * H * K]."""
    batch, heads = positions.shape[:2]
    offsets = torch.arange(batch * heads, device=positions.device).view(batch, heads, 1) * length
    return (positions + offsets).flatten()


def put(x: Tensor, positions: Tensor, rows: Tensor) -> None:
    """x [B, H, T, D] at `positions` [B, H, K] <- rows [B, H, K, D], in place."""
    dim = x.shape[-1]
    x.view(-1, dim).index_copy_(0, _flat_rows(positions, x.shape[2]), rows.reshape(-1, dim))


def _row_copy(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A contiguous copy of x [B, H, T, (D)] in `dtype` as rows [B * H * T, D or 1], in one pass."""
    rows = x.new_empty(x.shape[:3].numel(), x.shape[3] if x.dim() == 4 else 1, dtype=dtype)
    rows.view(x.shape).copy_(x)
    return rows
