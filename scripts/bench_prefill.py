"""Prefill at the machine's limit: a prefill's achieved GFLOP/s beside a large matmul's, in one run.

For each prompt length, one prefill through the harness's own path (`centroidkv.plan.decoding.prefill`,
a full cache, degree-aware attention) is timed, and its FLOPs are counted from the model's shapes:
2 FLOPs per multiply-add of every linear layer for every prompt token (the output projection for the
last token only: the prefill keeps one logit row), plus the causal attention, q k^T and p v over the
lower triangle (2 * 2 * heads * head_dim * L (L + 1) / 2 per layer). The achieved rate is divided by
a float32 matmul's rate measured in the same process on the same threads, before and after the
prefills, so the ratio says how close the prefill runs to what this CPU can do. Rates are per second
of the process's CPU time (the wall time is printed beside it): on a machine shared with other jobs
a thread waiting for a core does not count against either side.

The process keeps the memory it frees, as a job's processes do (`centroidkv.plan.heap`: no page
faults for a block reallocated), except for the heap's growth to each length's first peak, which
each length's prefill pays as a job's first sample does; `--glibc-heap` leaves glibc's malloc as it
is (the code before that change).

`--needs METHOD ...` adds rows whose prefill records what those methods need (SnapKV's query window,
H2O's received attention, CentroidKV's positions), as a job's shared prefill does.

    python scripts/bench_prefill.py                                   # qwen2.5-0.5b, 4k 16k 32k
    python scripts/bench_prefill.py --model smollm2-135m --lengths 2048 --needs snapkv h2o
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from centroidkv.errors import refused_in_one_line
from centroidkv.models.loading import check_model_name
from eval.machine_load import machine_load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--needs", nargs="*", default=[], metavar="METHOD",
                        help="also time prefills that record what these methods need")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--matmul-size", type=int, default=4096, help="n of the n x n float32 matmul")
    parser.add_argument("--glibc-heap", action="store_true",
                        help="leave malloc as glibc sets it (jobs keep their freed memory: centroidkv.plan.heap)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        if any(length < 2 for length in args.lengths):
            raise ValueError(f"--lengths must be at least 2 tokens, got {args.lengths}")
        if not 1 <= args.threads <= 256:
            raise ValueError(f"--threads must be 1..256, got {args.threads}")
        from centroidkv.methods import check_method_names

        check_method_names(args.needs, "--needs")
    return args


def matmul_gflops(size: int, repeats: int = 3) -> float:
    """The best of `repeats` n x n float32 matmuls, in GFLOP/s (2 n^3 FLOPs each)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: the BLAS's one-time costs
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        a @ b
        best = min(best, time.process_time() - start)
    return 2 * size**3 / best / 1e9


def prefill_flops(model: nn.Module, length: int) -> dict[str, float]:
    """FLOPs of one prefill of `length` tokens that keeps one logit row: linear layers and attention."""
    from centroidkv.attention import attention_modules

    config = attention_modules(model)[0].config
    output = model.get_output_embeddings()
    per_token = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not output
    )
    linear = 2 * per_token * length + 2 * output.in_features * output.out_features
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    triangle = length * (length + 1) / 2
    attention = config.num_hidden_layers * 2 * 2 * config.num_attention_heads * head_dim * triangle
    return {"linear": linear, "attention": attention, "total": linear + attention}


def time_prefill(model: nn.Module, length: int, needs: list) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one prefill of `length` deterministic token ids recording `needs`."""
    from centroidkv.plan.decoding import prefill

    vocab = model.config.vocab_size
    ids = (torch.arange(length) * 7919 % (vocab - 10) + 10).unsqueeze(0)
    start, wall = time.process_time(), time.perf_counter()
    prefill(model, ids, max_new_tokens=1, needs=needs)
    return time.process_time() - start, time.perf_counter() - wall


def measure(args: argparse.Namespace) -> list[dict]:
    from centroidkv import load_model
    from centroidkv.methods import get_method
    from centroidkv.plan.decoding import needs_of
    from centroidkv.plan.heap import keep_freed_memory

    torch.set_num_threads(args.threads)
    if not args.glibc_heap:
        keep_freed_memory()  # as a job's processes do (eval.workers.load_model_for)
    model = load_model(args.model)[0]
    time_prefill(model, 64, [])  # warm-up: the first forward's one-time costs
    matmul_before = matmul_gflops(args.matmul_size)
    variants = [("none", [])]
    if args.needs:
        variants.append(("+".join(args.needs), needs_of(get_method(name) for name in args.needs)))
    rows = []
    for length in tqdm(args.lengths, desc="prefill lengths", file=sys.stderr):
        flops = prefill_flops(model, length)
        for recorded, needs in variants:
            seconds, wall = time_prefill(model, length, needs)
            rows.append({"length": length, "needs": recorded, "seconds": seconds, "wall_s": wall, **{
                f"{part}_tflop": flops[part] / 1e12 for part in ("linear", "attention", "total")
            }, "gflops": flops["total"] / seconds / 1e9})  # fmt: skip
    matmul = (matmul_before + matmul_gflops(args.matmul_size)) / 2
    for row in rows:
        row.update(matmul_gflops=matmul, ratio=row["gflops"] / matmul)
    return rows


def table(rows: list[dict], args: argparse.Namespace, load: dict) -> str:
    lines = [
        f"{args.model}, {args.threads} thread(s), float32 matmul {args.matmul_size}^2: "
        f"{rows[0]['matmul_gflops']:.1f} GFLOP/s; heap: {'glibc' if args.glibc_heap else 'kept'}; load {load}",
        "",
        "| length | records | prefill CPU s (wall s) | TFLOP (linear + attention) | GFLOP/s | / matmul |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['needs']} | {r['seconds']:.1f} ({r['wall_s']:.1f}) | {r['total_tflop']:.2f} "
            f"({r['linear_tflop']:.2f} + {r['attention_tflop']:.2f}) | {r['gflops']:.1f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    print(table(rows, args, machine_load()))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
