"""The plugin's decode attention against vLLM's own C++ kernel, per layer, side by side in one run.

    .venv-serve/bin/python scripts/bench_plugin_attention.py [--shapes 4:2560,11:704,16:384] [--threads 1] [--layers 30]
        [--dtype bfloat16|float32]

For each shape (running requests : entries each) all attend one decoding query per request over
the same random blocks of 128 slots (bf16, or `--dtype float32`), on one thread (`--threads`: more): the plugin's decode
attention (float32 inside, log-degrees added: what every decoding row of a compressed request runs)
in PyTorch (`batched_degree_attention`) and as its C++ loop (`centroidkv_vllm.compiled`, the default;
built first if need be), and vLLM's `vec` kernel (`kernel_attention`: what stock vLLM runs; it has no
per-key term). The defaults are the rows of `make serve-bench`: the full cache's 4 running requests
at prompt + new tokens (2048 + 512), and R = 1/4 and 1/8 at their most running requests, each holding
R (prompt + new) + g (64) entries. Each timing is one pass over `--layers` layers (the embedded
model's 30), each with its own blocks and log-degrees, so that they stream from memory as a step's
do in the engine (`--layers 1`: one layer's blocks stay in the L3 cache, which flatters all three);
prints the median time per layer of each and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from centroidkv_vllm import require_vllm  # noqa: E402

require_vllm("bench_plugin_attention.py")  # before the imports below, which need vLLM

from centroidkv_vllm.compiled import COMPILED_DTYPES, compiled, decode_attention  # noqa: E402
from centroidkv_vllm.paged import DecodeBatch, kernel_attention  # noqa: E402

BLOCK = 128
HEADS, Q_HEADS, DIM = 3, 9, 64  # the embedded model's attention (SmolLM2-135M)
SCALE = DIM**-0.5


def median_ms(action: Callable[[], object], repeats: int) -> float:
    action()  # one untimed call: allocations and first-use costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def one_shape(
    requests: int, entries: int, layers: int, repeats: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(PyTorch ms, C++ loop ms, vLLM kernel ms) per layer for `requests` decoding rows over `entries`
    each, log-degrees 0, one pass over `layers` layers of their own blocks."""
    gen = torch.Generator().manual_seed(0)
    per_request = -(-entries // BLOCK)
    num_blocks = requests * per_request + 1  # block 0 is vLLM's null block
    caches = [torch.randn(num_blocks, HEADS, BLOCK, 2 * DIM, generator=gen).to(dtype) for _ in range(layers)]
    degrees = [torch.zeros(num_blocks * BLOCK, HEADS) for _ in range(layers)]
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: requests * per_request]
    table = table.view(requests, per_request).int()
    query = torch.randn(requests, Q_HEADS, DIM, generator=gen).to(dtype)
    batch = DecodeBatch.of(table, [(i, i, 0, entries) for i in range(requests)], BLOCK)
    seq_lens = torch.full((requests,), entries, dtype=torch.int32)
    query_start = torch.arange(requests + 1, dtype=torch.int32)

    def every_layer(attend: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[], None]:
        return lambda: [attend(kv_cache, degree) for kv_cache, degree in zip(caches, degrees)]

    pytorch, loop = (
        median_ms(
            every_layer(lambda kv, degree, use=use: decode_attention(query, kv, degree, batch, SCALE, use)),
            repeats,
        )
        for use in (False, True)
    )
    kernel = median_ms(
        every_layer(lambda kv, _: kernel_attention(query, kv, table, seq_lens, query_start, SCALE)), repeats
    )
    return pytorch / layers, loop / layers, kernel / layers


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(part) for part in item.split(":")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise SystemExit(f"error: --shapes takes requests:entries pairs, e.g. 4:2560,11:704; got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4:2560,11:704,16:384", help="requests:entries, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads, for all three")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=[str(dtype).removeprefix("torch.") for dtype in COMPILED_DTYPES],
        help="the cache's dtype",
    )
    parser.add_argument(
        "--layers", type=int, default=30, help="layers of their own blocks per pass (1: cache-resident)"
    )
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    if args.threads < 1 or args.layers < 1:
        raise SystemExit(f"error: --threads and --layers take counts >= 1, got {args.threads}, {args.layers}")
    torch.set_num_threads(args.threads)
    if compiled() is None:
        raise SystemExit("error: the C++ decode attention could not be built here (see the warning above)")
    print(
        "| requests x entries | PyTorch ms | C++ loop ms | vLLM kernel ms | PyTorch / loop | loop / kernel |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for requests, entries in shapes:
        pytorch, loop, kernel = one_shape(
            requests, entries, args.layers, args.repeats, getattr(torch, args.dtype)
        )
        print(
            f"| {requests} x {entries} | {pytorch:.2f} | {loop:.2f} | {kernel:.2f} "
            f"| {pytorch / loop:.1f} | {loop / kernel:.1f} |"
        )


if __name__ == "__main__":
    main()
