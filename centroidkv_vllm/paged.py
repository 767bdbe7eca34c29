"""A request's entries in vLLM's paged CPU KV cache, and attention over them with log-degrees.

One layer's cache is [num_blocks, H, block_size, 2 * D]. For the `vec`/`vec16` CPU kernels a block's
keys are stored transposed, [H, D, block_size], followed by its values, [H, block_size, D] (checked
against `cpu_attn_reshape_and_cache` in tests_serve/test_paged.py). Entries are written back through
that same kernel op, so only reading depends on the layout.

The log-degree of an entry (0 for an original token, log n for a centroid of n tokens; arXiv
2506.11418, Sec. 3) lives beside the cache in a float32 table indexed by slot, [num_slots, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from vllm import _custom_ops as ops


def request_slots(block_row: Tensor, start: int, end: int, block_size: int) -> Tensor:
    """Slots of a request's logical positions start..end-1, from its block-table row."""
    positions = torch.arange(start, end, dtype=torch.long)
    return block_row[positions // block_size].long() * block_size + positions % block_size


def split_cache(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(key_cache, value_cache) views in the shape the CPU kernel ops take, as the stock backend makes."""
    num_blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)


def read_entries(kv_cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values at `slots` [L]: two [H, L, D] tensors (copies)."""
    num_blocks, heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    halves = kv_cache.view(num_blocks, heads, 2, block_size * dim)
    keys = halves[:, :, 0].view(num_blocks, heads, dim, block_size)
    values = halves[:, :, 1].view(num_blocks, heads, block_size, dim)
    block, offset = slots // block_size, slots % block_size
    return keys[block, :, :, offset].transpose(0, 1), values[block, :, offset].transpose(0, 1)


def write_entries(kv_cache: Tensor, slots: Tensor, keys: Tensor, values: Tensor, isa: str) -> None:
    """Write keys and values [H, L, D] at `slots` [L] with vLLM's own cache-writing kernel."""
    key_cache, value_cache = split_cache(kv_cache)
    dtype = kv_cache.dtype
    ops.cpu_attn_reshape_and_cache(
        keys.transpose(0, 1).to(dtype).contiguous(),
        values.transpose(0, 1).to(dtype).contiguous(),
        key_cache,
        value_cache,
        slots,
        isa,
    )


def degree_attention(query: Tensor, keys: Tensor, values: Tensor, log_degree: Tensor, scale: float) -> Tensor:
    """softmax(scale * q.k + log n) v over one request's entries, causal at the end (bottom-right).

    query [t, Hq, D] (the request's last t tokens), keys/values [H, L, D], log_degree [H, L]; query
    head h reads KV head h // (Hq / H). Float32 inside; returns [t, Hq, D] in the query's dtype.
    """
    t, q_heads, dim = query.shape
    heads, length = log_degree.shape
    group = q_heads // heads
    q = query.float().transpose(0, 1).reshape(heads, group * t, dim)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scale)  # [H, group * t, L]
    logits += log_degree.float().unsqueeze(1)
    visible = torch.arange(length).view(1, length) <= torch.arange(length - t, length).view(t, 1)
    logits.view(heads, group, t, length).masked_fill_(~visible, float("-inf"))
    out = torch.bmm(logits.softmax(dim=-1), values.float())  # [H, group * t, D]
    return out.view(q_heads, t, dim).transpose(0, 1).to(query.dtype)


@dataclass(frozen=True)
class DecodeBatch:
    """The decoding rows (one query token) of requests that hold centroids, gathered by whole blocks.

    blocks [M, nb]: each row's blocks from the one holding its kept start (padded with the null
    block); a row's entries are its positions [first, first + held) in those blocks.
    """

    rows: Tensor  # [M] query token index of each row
    blocks: Tensor  # [M, nb] block ids
    first: Tensor  # [M] offset of each row's kept start in its first block (int64)
    held: Tensor  # [M] entries each row holds (int64)

    @classmethod
    def of(cls, block_table: Tensor, rows: list[tuple[int, int, int, int]], block_size: int) -> DecodeBatch:
        """rows: (batch index, query token index, kept start, length) of each decoding row."""
        first_block = [start // block_size for _, _, start, _ in rows]
        count = [-(-length // block_size) - f for (_, _, _, length), f in zip(rows, first_block)]
        blocks = torch.zeros(len(rows), max(count), dtype=torch.long)
        for m, ((index, _, _, _), f, n) in enumerate(zip(rows, first_block, count)):
            blocks[m, :n] = block_table[index, f : f + n].long()
        tokens = torch.tensor([token for _, token, _, _ in rows], dtype=torch.long)
        first_offsets = torch.tensor([start % block_size for _, _, start, _ in rows], dtype=torch.long)
        held = torch.tensor([length - start for _, _, start, length in rows], dtype=torch.long)
        return cls(tokens, blocks, first_offsets, held)

    def valid(self, block_size: int) -> Tensor:
        """[M, nb * block_size] bool: the positions of each row's entries in its gathered blocks."""
        positions = torch.arange(self.blocks.shape[1] * block_size)
        return (positions >= self.first[:, None]) & (positions < (self.first + self.held)[:, None])


def gather_blocks(kv_cache: Tensor, log_degree: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Whole blocks [M, nb] in float32, in their stored layout: keys [M, nb, H, D, bs], values
    [M, nb, H, bs, D], and log-degrees [M, H, nb * bs]."""
    num_blocks, heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    m, nb = blocks.shape
    picked = kv_cache.view(num_blocks, heads, 2, block_size * dim)[blocks.flatten()].float()
    keys = picked[:, :, 0].view(m, nb, heads, dim, block_size)
    values = picked[:, :, 1].view(m, nb, heads, block_size, dim)
    degree = log_degree.view(num_blocks, block_size, heads)[blocks].permute(0, 3, 1, 2)
    return keys, values, degree.reshape(m, heads, nb * block_size)


def batched_degree_attention(
    query: Tensor, kv_cache: Tensor, log_degree: Tensor, batch: DecodeBatch, scale: float
) -> Tensor:
    """`degree_attention` for many one-token queries [M, Hq, D] at once, float32 inside, block by block
    (the keys are multiplied in their stored [D, bs] layout, nothing is transposed). Positions
    outside a row's entries get probability 0; their values are finite (vLLM zeroes the cache at
    allocation and writes only model outputs), so they add nothing."""
    keys, values, degree = gather_blocks(kv_cache, log_degree, batch.blocks)
    m, nb, heads, dim, block_size = keys.shape
    group = query.shape[1] // heads
    q = query.float().view(m, 1, heads, group, dim)  # query head h reads KV head h // group
    logits = torch.matmul(q, keys).mul_(scale)  # [M, nb, H, group, bs]
    logits = logits.permute(0, 2, 3, 1, 4).reshape(m, heads, group, nb * block_size)
    logits += degree.unsqueeze(2)
    logits.masked_fill_(~batch.valid(block_size).view(m, 1, 1, -1), float("-inf"))
    probs = logits.softmax(dim=-1).view(m, heads, group, nb, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(probs, values).sum(dim=1)  # [M, H, group, D]
    return out.reshape(m, heads * group, dim).to(query.dtype)


def kernel_attention(
    query: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, query_start: Tensor, scale: float
) -> Tensor:
    """vLLM's own C++ CPU attention (the `vec` kernel, causal, no log-degrees) over requests' blocks,
    as the stock backend calls it: the reference `degree_attention` is tested and timed against.

    query [T, Hq, D]; block_table [R, nb] and seq_lens [R] int32; query_start [R + 1] int32."""
    num_blocks, heads, block_size, two_dim = kv_cache.shape
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=query.shape[1],
        num_kv_heads=heads,
        head_dim=two_dim // 2,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start,
        causal=True,
        sliding_window_size=-1,
        isa="vec",
        enable_kv_split=False,
    )
    output = torch.empty_like(query)
    key_cache, value_cache = split_cache(kv_cache)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=scheduler,
        s_aux=None,
    )
    return output
