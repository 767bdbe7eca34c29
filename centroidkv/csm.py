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
    """Every A slot's best B partner in its chunk: (best similarity, B position), each [B, H, n_A].

    keys: [B, H, T, D]. A slot s sits at position 2 * s; slots without a real B partner (padding of
    the last chunk) score -inf. Cost O(T * chunk_size * D) per head instead of O(T^2 * D) for all pairs.
    """
    batch, heads, length, head_dim = keys.shape
    half = chunk_size // 2
    n_chunks = -(-length // chunk_size)
    padding = n_chunks * chunk_size - length
    # Cosine similarity without a normalised copy of the whole cache: only the B half is divided by
    # its norms; an A slot's norm scales its row uniformly, so it is applied to the row's best score.
    keys = keys if keys.dtype == torch.float32 else keys.float()
    norms = torch.linalg.vector_norm(keys, dim=-1).clamp_min_(1e-12)  # F.normalize's eps
    if padding:
        keys = F.pad(keys, (0, 0, 0, padding))
        norms = F.pad(norms, (0, padding), value=1.0)
    # Because chunk_size is even, "even position inside the chunk" is "even position in the sequence".
    pairs = keys.view(batch, heads, n_chunks, half, 2, head_dim)
    norm_pairs = norms.view(batch, heads, n_chunks, half, 2)
    set_a, set_b = pairs[..., 0, :], pairs[..., 1, :] / norm_pairs[..., 1, None]
    similarity = set_a @ set_b.transpose(-1, -2)  # [B, H, chunks, half (A), half (B)], times |a|
    if padding:  # padding B slots are never chosen (an A slot without a real B partner gets -inf)
        last_a = 2 * torch.arange(half, device=keys.device) + (n_chunks - 1) * chunk_size
        similarity[:, :, -1].masked_fill_((last_a + 1 >= length)[None, None, None, :], float("-inf"))
    best_score, best_b = similarity.max(dim=-1)  # [B, H, chunks, half]
    best_score /= norm_pairs[..., 0]
    if padding:  # padding A slots are never merged, even when every real edge is negative
        best_score[:, :, -1].masked_fill_((last_a >= length)[None, None, :], float("-inf"))
    chunk_start = torch.arange(n_chunks, device=keys.device).view(n_chunks, 1) * chunk_size
    return best_score.flatten(2), (chunk_start + 2 * best_b + 1).flatten(2)


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


def merge_tokens(kv: LayerKV, src: Tensor, dst: Tensor) -> LayerKV:
    """Merge the tokens at `src` into those at `dst` ([B, H, M]) by degree-weighted means.

    x_b <- (n_b x_b + sum n_a x_a) / (n_b + sum n_a) for keys and values; n_b <- n_b + sum n_a.
    Written as x_b + sum_a w_a (x_a - x_b) with w_a = n_a / (n_b + sum n_a), so only the M merged
    rows are computed (in float32) and the rest is a single row copy. Degrees stay in float32, so
    half-precision caches handle degrees of 1e5 and more. The surviving tokens keep their order.
    """
    batch, heads, length = kv.log_degree.shape
    n_merge = src.shape[-1]
    # Flatten (batch, head, token) into rows so gathers and scatters move whole rows.
    offsets = (torch.arange(batch * heads, device=src.device) * length).view(batch, heads, 1)
    src_row, dst_row = (src + offsets).flatten(), (dst + offsets).flatten()
    degree = kv.log_degree.float().exp().flatten()
    new_degree = degree.index_add(0, dst_row, degree[src_row])
    weight = (degree[src_row] / new_degree[dst_row]).unsqueeze(1)

    is_src = torch.zeros(batch * heads * length, dtype=torch.bool, device=src.device)
    is_src[src_row] = True
    keep_row = (~is_src).nonzero().squeeze(1)  # survivors, in order; every head keeps length - M
    dst_kept = (~is_src).cumsum(0)[dst_row] - 1  # where each destination lands among the survivors

    def merged(x: Tensor) -> Tensor:
        rows = x.reshape(batch * heads * length, -1)
        # index_select, not rows[index]: the advanced-indexing kernel is several times slower on a CPU
        delta = (rows.index_select(0, src_row).float() - rows.index_select(0, dst_row).float()) * weight
        out = rows.index_select(0, keep_row).index_add_(0, dst_kept, delta.to(x.dtype))
        return out.view(batch, heads, length - n_merge, -1)

    def summed(x: Tensor) -> Tensor:  # e.g. a centroid has received the attention of all its members
        flat = x.flatten()
        return flat.index_add(0, dst_row, flat[src_row])[keep_row].view(batch, heads, -1)

    extras = {  # entry records follow the merge by their declared rule (centroidkv.needs)
        name: merged(record.unsqueeze(-1)).squeeze(-1) if merge_rule(name) == "mean" else summed(record)
        for name, record in kv.extras.items()
    }
    return LayerKV(
        keys=merged(kv.keys),
        values=merged(kv.values),
        log_degree=new_degree.log()[keep_row].view(batch, heads, -1),
        extras=extras,
    )


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
    match_keys: Callable[[LayerKV], Tensor] | None = None,
) -> LayerKV:
    """Run rounds until `target_len` tokens remain; the schedule sets each round's merge count.

    `match_keys(kv)` gives the keys similarity is computed on (default: the cached keys); merging
    always averages the cached keys and values.
    """
    for round_idx in range(max_rounds):
        excess = kv.length - target_len
        if excess <= 0:
            return kv
        best_score, best_dst = best_edges(kv.keys if match_keys is None else match_keys(kv), chunk_size)
        n_pairs = kv.length // 2  # A tokens that have a B partner (at least)
        n_merge = schedule.merge_count(round_idx, best_score, n_pairs, excess)
        kv = merge_tokens(kv, *top_edges(best_score, best_dst, n_merge))
    raise RuntimeError(f"CSM did not reach {target_len} tokens in {max_rounds} rounds")
