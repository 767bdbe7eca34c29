"""The plugin's paged-cache access and its log-degree attention (run in .venv-serve: `make serve-test`)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm._custom_ops")

from centroidkv_vllm.paged import (  # noqa: E402
    degree_attention,
    kernel_attention,
    read_entries,
    request_slots,
    split_cache,
)

BLOCK = 128
HEADS, Q_HEADS, DIM = 3, 9, 64  # the embedded model's grouping (3 query heads per KV head) and head dim
SCALE = DIM**-0.5


def paged_request(length: int, isa: str = "vec", seed: int = 0):
    """A request of `length` random bf16 entries written by vLLM's kernel into shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = (length + BLOCK - 1) // BLOCK
    kv_cache = torch.zeros(n_blocks + 3, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    row = torch.randperm(n_blocks + 2, generator=gen)[:n_blocks].int() + 1  # block 0 is vLLM's null block
    keys = torch.randn(length, HEADS, DIM, generator=gen).bfloat16()
    values = torch.randn(length, HEADS, DIM, generator=gen).bfloat16()
    slots = request_slots(row, 0, length, BLOCK)
    ops.cpu_attn_reshape_and_cache(keys, values, *split_cache(kv_cache), slots, isa)
    return kv_cache, row, slots, keys, values


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_read_entries_reads_what_vllm_wrote(isa):
    kv_cache, _, slots, keys, values = paged_request(300, isa)
    read_k, read_v = read_entries(kv_cache, slots)
    assert torch.equal(read_k, keys.transpose(0, 1)) and torch.equal(read_v, values.transpose(0, 1))


def dense_reference(query, keys, values, log_degree):
    """softmax(scale q.k + log n) v in float64, causal at the end; query [t, Hq, D], keys [L, H, D]."""
    t, length = query.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(Q_HEADS // HEADS, dim=1)  # [L, Hq, D]
    v = values.double().repeat_interleave(Q_HEADS // HEADS, dim=1)
    bias = log_degree.double().repeat_interleave(Q_HEADS // HEADS, dim=0)  # [Hq, L]
    logits = torch.einsum("thd,lhd->htl", query.double(), k) * SCALE + bias[:, None, :]
    visible = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("htl,lhd->thd", logits.softmax(-1), v)


@pytest.mark.parametrize("t", [1, 5])
def test_degree_attention_equals_dense_reference(t):
    length = 300
    kv_cache, _, slots, keys, values = paged_request(length)
    query = torch.randn(t, Q_HEADS, DIM, generator=torch.Generator().manual_seed(1)).bfloat16()
    degree = torch.randint(1, 50, (HEADS, length), generator=torch.Generator().manual_seed(2)).float()
    read_k, read_v = read_entries(kv_cache, slots)
    out = degree_attention(query, read_k, read_v, degree.log(), SCALE)
    expected = dense_reference(query, keys, values, degree.log())
    error = (out.double() - expected).abs().max().item()
    assert error < 1e-2, error  # bf16 output: a relative rounding of 2^-8 on values of order 1
    unbiased = dense_reference(query, keys, values, torch.zeros_like(degree))
    assert (unbiased - expected).abs().max().item() > 0.05  # the log-degree term is really there


def test_a_centroid_of_degree_n_attends_as_n_copies():
    """The defining property of log n (arXiv 2506.11418, Sec. 3): one entry of degree n gets the
    attention mass of n identical tokens."""
    kv_cache, _, slots, keys, values = paged_request(40)
    query = torch.randn(1, Q_HEADS, DIM, generator=torch.Generator().manual_seed(3)).bfloat16()
    read_k, read_v = read_entries(kv_cache, slots)
    degree = torch.ones(HEADS, 40)
    degree[:, 7] = 5.0
    merged = degree_attention(query, read_k, read_v, degree.log(), SCALE)
    copies = torch.cat([read_k[:, :7], read_k[:, 7:8].expand(-1, 4, -1), read_k[:, 7:]], dim=1)
    copies_v = torch.cat([read_v[:, :7], read_v[:, 7:8].expand(-1, 4, -1), read_v[:, 7:]], dim=1)
    repeated = degree_attention(query, copies, copies_v, torch.zeros(HEADS, 44), SCALE)
    assert (merged.float() - repeated.float()).abs().max().item() < 1e-2


@pytest.mark.parametrize("t", [1, 200])
def test_degrees_one_equal_vllm_kernel(t):
    """With every degree 1 the plugin's attention is vLLM's own kernel's, to bf16 rounding."""
    length = 300
    kv_cache, row, slots, _, _ = paged_request(length)
    query = torch.randn(t, Q_HEADS, DIM, generator=torch.Generator().manual_seed(4)).bfloat16()
    seq_lens = torch.tensor([length], dtype=torch.int32)
    query_start = torch.tensor([0, t], dtype=torch.int32)
    stock = kernel_attention(query, kv_cache, row[None], seq_lens, query_start, SCALE)
    read_k, read_v = read_entries(kv_cache, slots)
    ours = degree_attention(query, read_k, read_v, torch.zeros(HEADS, length), SCALE)
    error = (ours.float() - stock.float()).abs().max().item()
    assert error < 1e-2, error


@pytest.mark.parametrize("use_compiled", [False, True], ids=["pytorch", "compiled"])
@pytest.mark.parametrize(
    "heads,q_heads,dim",
    [(HEADS, Q_HEADS, DIM), (1, 10, 128), (2, 2, 80)],
    ids=["smollm2", "group-10-dim-128", "group-1-dim-80"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_batched_decode_attention_equals_one_request_at_a_time(use_compiled, heads, q_heads, dim, dtype):
    """Rows that hold centroids and decode one token are attended together, by whole blocks from the
    one holding each kept start; each must equal `degree_attention` over its own entries, by PyTorch
    and by the C++ loop (built here unless the machine has no C++ compiler), whose query heads per KV
    head go 8 at a time (10: two passes) over head dims of 16-lane steps, in a bf16 or float32 cache."""
    from centroidkv_vllm.compiled import compiled, decode_attention
    from centroidkv_vllm.paged import DecodeBatch

    if use_compiled:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler on this machine: the plugin keeps the PyTorch path")
        assert compiled() is not None

    gen = torch.Generator().manual_seed(5)
    num_blocks = 40
    kv_cache = torch.randn(num_blocks, heads, BLOCK, 2 * dim, generator=gen).to(dtype)
    log_degree = torch.rand(num_blocks * BLOCK, heads, generator=gen)
    table = torch.randperm(num_blocks - 1, generator=gen)[:24].view(3, 8).int() + 1
    rows = [(0, 0, 0, 300), (1, 1, 200, 517), (2, 2, 700, 1001)]  # (row, token, kept start, length)
    query = torch.randn(3, q_heads, dim, generator=gen).to(dtype)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the output is rounded to the cache's dtype
    batch = DecodeBatch.of(table, rows, BLOCK)
    scale = dim**-0.5
    out = decode_attention(query, kv_cache, log_degree, batch, scale, use_compiled)
    for index, token, start, length in rows:
        slots = request_slots(table[index], start, length, BLOCK)
        keys, values = read_entries(kv_cache, slots)
        one = degree_attention(query[token : token + 1], keys, values, log_degree[slots].t(), scale)
        assert out.dtype == dtype
        assert (out[token].float() - one[0].float()).abs().max().item() < tolerance
    if use_compiled:  # the loop splits (request, KV head) pairs over torch's threads: not a bit moves
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = decode_attention(query, kv_cache, log_degree, batch, scale, use_compiled)
            torch.set_num_threads(4)
            split = decode_attention(query, kv_cache, log_degree, batch, scale, use_compiled)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, split)


def test_the_attention_benchmark_times_both_on_the_same_blocks(capsys):
    """scripts/bench_plugin_attention.py: one table row per shape, every time positive; a shape that
    is not requests:entries, or no layer, is one error line."""
    from scripts.bench_plugin_attention import main, one_shape

    main(["--shapes", "2:300,3:129", "--repeats", "2", "--layers", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 2 x 300", "| 3 x 129"]
    assert all(ms > 0 for ms in one_shape(2, 300, 3, 2, torch.bfloat16))
    main(["--shapes", "2:300", "--repeats", "2", "--layers", "2", "--dtype", "float32"])
    assert capsys.readouterr().out.splitlines()[2].startswith("| 2 x 300 |")
    with pytest.raises(SystemExit, match="requests:entries"):
        main(["--shapes", "2:0"])
    with pytest.raises(SystemExit, match="--layers"):
        main(["--layers", "0"])
