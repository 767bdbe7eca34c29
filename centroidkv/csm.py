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

import torch
import torch.nn.functional as F
from torch import Tensor

from centroidkv.methods import LayerKV
from centroidkv.schedule import LinearSchedule


def match_within_chunks(keys: Tensor, n_merge: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Pick the `n_merge` best A->B edges; return their source and destination token indices.

    keys: [B, H, T, D]. Returns `src`, `dst`: [B, H, n_merge] int64 positions in the sequence.
    Cost O(T * chunk_size * D) per head instead of O(T^2 * D) for all pairs.
    """
    batch, heads, length, head_dim = keys.shape
    half = chunk_size // 2
    if n_merge > length // 2:
        raise ValueError(f"cannot merge {n_merge} of {length} tokens in one round (at most half)")
    n_chunks = -(-length // chunk_size)
    padded = F.pad(F.normalize(keys.float(), dim=-1), (0, 0, 0, n_chunks * chunk_size - length))
    # Because chunk_size is even, "even position inside the chunk" is "even position in the sequence".
    pairs = padded.view(batch, heads, n_chunks, half, 2, head_dim)
    set_a, set_b = pairs[..., 0, :], pairs[..., 1, :]
    similarity = set_a @ set_b.transpose(-1, -2)  # [B, H, chunks, half (A), half (B)]

    # Padding B slots must never be chosen; A slots without any real B partner score -inf.
    slot = torch.arange(n_chunks * half, device=keys.device).view(n_chunks, half)
    b_position = 2 * slot + 1  # B slot s sits right after A slot s
    similarity = similarity.masked_fill((b_position >= length)[None, None, :, None, :], float("-inf"))
    best_score, best_b = similarity.max(dim=-1)  # [B, H, chunks, half]

    top_a = best_score.flatten(2).topk(n_merge, dim=-1).indices  # A slot ids, [B, H, n_merge]
    chosen_b = best_b.flatten(2).gather(-1, top_a)
    src = 2 * top_a  # A slot s sits at position chunk * c + 2 * (s % half) = 2 * s
    dst = (top_a // half) * chunk_size + 2 * chosen_b + 1
    return src, dst


def merge_tokens(kv: LayerKV, src: Tensor, dst: Tensor) -> LayerKV:
    """Merge the tokens at `src` into those at `dst` ([B, H, M]) by degree-weighted means.

    x_b <- (n_b x_b + sum n_a x_a) / (n_b + sum n_a) for keys and values; n_b <- n_b + sum n_a.
    Sums run in float32 so degrees up to 1e5+ stay exact enough in half precision caches.
    The surviving tokens keep their order.
    """
    batch, heads, length = kv.log_degree.shape
    degree = kv.log_degree.float().exp()

    def weighted_mean(x: Tensor) -> Tensor:
        src_x, dst_x = (i.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]) for i in (src, dst))
        total = x.float() * degree.unsqueeze(-1)
        total.scatter_add_(2, dst_x, total.gather(2, src_x))
        return total

    keys_sum, values_sum = weighted_mean(kv.keys), weighted_mean(kv.values)
    new_degree = degree.scatter_add(2, dst, degree.gather(2, src))
    keys = (keys_sum / new_degree.unsqueeze(-1)).to(kv.keys.dtype)
    values = (values_sum / new_degree.unsqueeze(-1)).to(kv.values.dtype)
    attention_sum = kv.attention_sum
    if attention_sum is not None:  # a centroid has received the attention of all its members
        attention_sum = attention_sum.scatter_add(2, dst, attention_sum.gather(2, src))
    merged = LayerKV(keys, values, new_degree.log(), attention_sum)

    # Drop the sources: a stable sort of the "is source" flags lists the survivors first, in order.
    is_src = torch.zeros(batch, heads, length, dtype=torch.int8, device=src.device).scatter_(2, src, 1)
    keep = torch.sort(is_src, dim=-1, stable=True).indices[..., : length - src.shape[-1]]
    return merged.select(keep)


def csm_round(kv: LayerKV, n_merge: int, chunk_size: int) -> LayerKV:
    """One round of Chunked Soft Matching that removes exactly `n_merge` tokens."""
    src, dst = match_within_chunks(kv.keys, n_merge, chunk_size)
    return merge_tokens(kv, src, dst)


def csm_compress(
    kv: LayerKV, target_len: int, chunk_size: int, schedule: LinearSchedule, max_rounds: int = 256
) -> LayerKV:
    """Run rounds until `target_len` tokens remain; round j merges min(excess, floor(r_j * |A|))."""
    for round_idx in range(max_rounds):
        excess = kv.length - target_len
        if excess <= 0:
            return kv
        n_pairs = kv.length // 2  # A tokens that have a B partner (at least)
        n_merge = min(excess, max(1, int(schedule.rate(round_idx) * n_pairs)))
        kv = csm_round(kv, n_merge, chunk_size)
    raise RuntimeError(f"CSM did not reach {target_len} tokens in {max_rounds} rounds")
