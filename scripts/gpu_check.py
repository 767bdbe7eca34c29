"""Everything a lent GPU can show about the paper's speed and memory claims, in one output folder.

Run through `scripts/gpu_check.sh` (which checks the packages first). Sections, each timed and
isolated (a failing section is reported and the next one runs):

1. TPOT, full cache vs CentroidKV at 0.25, at 16k / 32k / 64k prompt tokens, random-llama3.1-8b in
   bf16, beside the paper's figures; TTFT; peak GPU memory (torch.cuda.max_memory_allocated) of each
   run, the 64k pair beside the paper's 31.83 vs 18.36 GB.
2. Compression time per call (one CentroidKV compression of one layer: 8 KV heads, head_dim 128, to
   25 %) at each length, and K-Means (10 Lloyd iterations) at 32k: the CSM vs K-Means ratio.
3. The throughput table of `bench_throughput.py` (largest batch under a KV cap, decode tokens/s).
4. FlexAttention (compiled on CUDA) and flash-attn against the reference SDPA-with-bias path: max error and
   time per call; and CentroidKV's TPOT at the middle length with the fused path off.

`--dry-run` runs the same code at tiny sizes on the CPU (tiny-llama, short prompts), for the tests.
Writes `summary.md` (the tables) and `results.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from centroidkv.errors import first_line

# The paper's v1 figures (Llama-3.1-8B, one GPU): TPOT full vs method, and peak memory at 64k.
PAPER_TPOT_S = {16384: (0.043, 0.035), 32768: (0.071, 0.036), 65536: (0.137, 0.043)}
PAPER_MEMORY_64K_GB = (31.83, 18.36)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, help="run these sections alone (default: all of them)"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        torch.set_num_threads(1)  # small tensors on a possibly shared CPU
        args.model, args.device, args.dtype = "tiny-llama", "cpu", torch.float32
        args.lengths, args.new_tokens, args.compress_lengths, args.kmeans_length = (
            [512, 1024],
            6,
            [1024],
            1024,
        )
        args.throughput = ["--length", "512", "--new-tokens", "4", "--full-batch", "2"]
        args.flex_shapes = [(16, 256), (1, 300)]  # uncompiled on a CPU (tests/test_flex.py compiles it)
    else:
        if not torch.cuda.is_available():
            parser.exit(2, "gpu_check: error: no CUDA device (use --dry-run on a CPU)\n")
        args.model, args.device, args.dtype = "random-llama3.1-8b", "cuda", torch.bfloat16
        args.lengths, args.new_tokens = [16384, 32768, 65536], 128
        args.compress_lengths, args.kmeans_length = [16384, 32768, 65536], 32768
        args.throughput = ["--length", "8192", "--new-tokens", "80", "--full-batch", "8", "--max-batch", "48"]
        args.flex_shapes = [(1, 32768), (1, 65536), (256, 32768)]
    return args


class Report:
    """Markdown sections and a JSON record, rewritten after every section (a killed run keeps them)."""

    def __init__(self, out: Path):
        self.out, self.lines, self.data = out, [], {}
        out.mkdir(parents=True, exist_ok=True)

    def section(self, title: str, fn, *args) -> None:
        print(f"\n== {title}", flush=True)
        started = time.perf_counter()
        try:
            self.data[title] = fn(self, *args)
        except Exception as error:  # one section's failure must not lose the others
            traceback.print_exc()
            self.add(f"**{title} failed:** `{first_line(error, with_type=True)[:300]}`")
            self.data[title] = {"error": repr(error)}
        self.add(f"_({title}: {time.perf_counter() - started:.0f} s)_\n")
        self.flush()

    def add(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def flush(self) -> None:
        (self.out / "summary.md").write_text("\n".join(self.lines) + "\n")
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str))


def environment(report: Report, args) -> dict:
    import transformers

    from centroidkv.flex import flash_attn_available, flex_available

    info = dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        flex=flex_available(),
        flash_attn=flash_attn_available(),
        dry_run=args.dry_run,
    )
    report.add("# GPU check" + (" (dry run on CPU)" if args.dry_run else ""))
    report.add("\n" + ", ".join(f"{k}: {v}" for k, v in info.items()) + "\n")
    return info


TRANSFORMERS = "transformers"  # the reference row: transformers' DynamicCache and stock SDPA attention


@torch.inference_mode()
def transformers_decode(model, ids: torch.Tensor, new_tokens: int):
    """`bench_throughput.decode_run`'s prefill and greedy steps through transformers' own cache and
    attention (the model's degree-aware attention switched off meanwhile): what a decode step costs
    without this harness, on the same model and machine."""
    from bench_throughput import Decoded, timed_steps
    from transformers import DynamicCache

    from centroidkv.plan.timing import Timer

    harness_attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        cache, timer = DynamicCache(config=model.config), Timer(ids.device)
        with timer.span() as prefill:
            logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
        times = timed_steps(model, logits, cache, new_tokens - 1, timer)
    finally:
        model.set_attn_implementation(harness_attention)
    kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    tpot = sum(times[1:]) / len(times[1:])
    return Decoded(kv_bytes, ids.shape[0] / tpot, tpot, prefill.seconds)


def tpot_and_memory(report: Report, args, model) -> dict:
    from bench_throughput import decode_run, method_for

    cuda = args.device == "cuda"
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    report.add(f"## TPOT and peak memory: {args.model} ({args.dtype}), {args.new_tokens} new tokens\n")
    report.add(f"weights {weights_gb:.2f} GB\n")
    report.add("| n | method | TTFT s | TPOT s | paper TPOT s | peak GPU GB | KV GB (peak) |")
    report.add("|---:|---|---:|---:|---:|---:|---:|")
    warm_up = torch.randint(3, model.config.vocab_size, (1, 512), device=args.device)
    decode_run(
        model, warm_up, method_for("centroidkv", args.model), 0.25, 4
    )  # kernels chosen/compiled before anything is timed
    rows = []
    for length in args.lengths:
        ids = torch.randint(3, model.config.vocab_size, (1, length), device=args.device)
        for index, (method, budget) in enumerate((("full", 1.0), ("centroidkv", 0.25), (TRANSFORMERS, 1.0))):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if method == TRANSFORMERS:
                decoded = transformers_decode(model, ids, args.new_tokens)
            else:
                decoded = decode_run(model, ids, method_for(method, args.model), budget, args.new_tokens)
            peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
            paper = (*PAPER_TPOT_S.get(length, (float("nan"),) * 2), float("nan"))[index]
            rows.append(dict(n=length, method=method, ttft_s=decoded.prefill_s, tpot_s=decoded.tpot_s,
                             paper_tpot_s=paper, peak_gpu_gb=peak, kv_gb=decoded.peak_bytes / 1e9))  # fmt: skip
            report.add(
                f"| {length} | {method} {budget:g} | {decoded.prefill_s:.2f} | {decoded.tpot_s:.4f} | {paper} | "
                f"{peak:.2f} | {decoded.peak_bytes / 1e9:.2f} |"
            )
    by = {(r["n"], r["method"]): r for r in rows}
    report.add("")
    for length in args.lengths:
        full, ours = by[length, "full"], by[length, "centroidkv"]
        paper = PAPER_TPOT_S.get(length)
        paper_speedup = f"{paper[0] / paper[1]:.2f}x" if paper else "n/a"
        stock = by[length, TRANSFORMERS]
        report.add(
            f"- {length}: TPOT speed-up {full['tpot_s'] / ours['tpot_s']:.2f}x (paper {paper_speedup}); "
            f"this harness's full cache / transformers' own: {full['tpot_s'] / stock['tpot_s']:.2f}x"
        )
    longest = args.lengths[-1]
    report.add(
        f"- peak GPU memory at {longest}: full {by[longest, 'full']['peak_gpu_gb']:.2f} GB vs CentroidKV "
        f"{by[longest, 'centroidkv']['peak_gpu_gb']:.2f} GB (paper at 64k: {PAPER_MEMORY_64K_GB[0]} vs "
        f"{PAPER_MEMORY_64K_GB[1]} GB)\n"
    )
    return dict(rows=rows, weights_gb=weights_gb)


def compression_cost(report: Report, args, _model) -> dict:
    from bench_kmeans import correlated_keys

    from baselines.kmeans import kmeans_compress
    from centroidkv import get_method
    from centroidkv.methods import LayerKV, LayerStats
    from centroidkv.plan.timing import Timer

    csm, timer = (
        get_method("centroidkv", similarity="post_rope"),
        Timer(args.device),
    )  # raw CSM: no model, no positions

    def layer(n: int) -> LayerKV:
        keys = correlated_keys(8, n, 128).to(args.device, args.dtype)
        return LayerKV(keys, torch.randn_like(keys), torch.zeros(keys.shape[:3], device=args.device))

    def best(fn, repeats=3) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            with timer.span() as span:
                fn()
            times.append(span.seconds)
        return min(times)

    stats = LayerStats(layer_idx=0, n_layers=1, scaling=128**-0.5)
    report.add("## Compression time per call (one layer, 8 KV heads x 128, to 25 %)\n")
    report.add("| n | CentroidKV (CSM) ms |")
    report.add("|---:|---:|")
    rows = {}
    for n in args.compress_lengths:
        kv = layer(n)
        rows[n] = best(lambda kv=kv, n=n: csm.compress(kv, n // 4, stats))
        report.add(f"| {n} | {rows[n] * 1e3:.2f} |")
    n = args.kmeans_length
    kv = layer(n)
    csm_s = rows.get(n) or best(lambda: csm.compress(kv, n // 4, stats))
    kmeans_s = best(lambda: kmeans_compress(kv, n // 4, 10, stop_at_fixed_point=False), repeats=1)
    report.add(
        f"\nK-Means (10 iterations) at {n}: {kmeans_s * 1e3:.1f} ms; CSM {csm_s * 1e3:.2f} ms; "
        f"K-Means / CSM = {kmeans_s / csm_s:.0f}x\n"
    )
    return dict(csm_s=rows, kmeans_s=kmeans_s, kmeans_length=n, ratio=kmeans_s / csm_s)


def throughput(report: Report, args, model) -> dict:
    import contextlib
    import io

    import bench_throughput

    targs = bench_throughput.parse_args(["--model", args.model, *args.throughput])
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        runs = bench_throughput.throughput_table(targs, model, None)
    report.add(captured.getvalue().strip() + "\n")
    return dict(runs=[vars(run) for run in runs])


def fused_paths(report: Report, args, model) -> dict:
    from bench_throughput import decode_run, method_for

    from centroidkv.attention import _biased_attention
    from centroidkv.flex import attention_backend, flash_attn_available, flash_prefill, flex_degree_attention
    from centroidkv.plan.timing import Timer

    timer, results = Timer(args.device), []
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, 128
    report.add("## Fused attention vs the reference (SDPA with a float bias)\n")
    report.add("| path | q | T | max abs error | fused ms | reference ms |")
    report.add("|---|---:|---:|---:|---:|---:|")

    def time_of(fn) -> float:
        fn()
        with timer.span() as span:
            for _ in range(5):
                fn()
        return span.seconds / 5

    for q_len, length in args.flex_shapes:
        gen = torch.Generator(device=args.device).manual_seed(0)
        query = torch.randn(1, heads, q_len, dim, device=args.device, generator=gen).to(args.dtype)
        key = torch.randn(1, kv_heads, length, dim, device=args.device, generator=gen).to(args.dtype)
        value = torch.randn_like(key)
        log_degree = torch.rand(1, kv_heads, length, device=args.device, generator=gen) * 3
        scale = dim**-0.5
        reference = _biased_attention(query, key, value, log_degree, scale, 0.0)
        fused = flex_degree_attention(query, key, value, log_degree, scale)
        error = float((fused.float() - reference.float()).abs().max())
        inputs = (query, key, value, log_degree, scale)
        fused_s = time_of(lambda inputs=inputs: flex_degree_attention(*inputs))
        reference_s = time_of(lambda inputs=inputs: _biased_attention(*inputs, 0.0))
        results.append(
            dict(path="flex", q=q_len, T=length, error=error, fused_s=fused_s, reference_s=reference_s)
        )
        report.add(
            f"| flex + log n | {q_len} | {length} | {error:.2e} | {fused_s * 1e3:.3f} | {reference_s * 1e3:.3f} |"
        )
        if args.device == "cuda" and flash_attn_available() and q_len > 1:
            square = query[:, :, -q_len:], key[:, :, :q_len], value[:, :, :q_len]
            reference = _biased_attention(*square, None, scale, 0.0)
            error = float((flash_prefill(*square, scale).float() - reference.float()).abs().max())
            report.add(f"| flash-attn prefill | {q_len} | {q_len} | {error:.2e} | | |")
            results.append(dict(path="flash", q=q_len, T=q_len, error=error))
    length = args.lengths[len(args.lengths) // 2]
    ids = torch.randint(3, model.config.vocab_size, (1, length), device=args.device)
    tpots = {}
    for backend in ("auto", "sdpa"):
        with attention_backend(backend):
            centroidkv = method_for("centroidkv", args.model)
            tpots[backend] = decode_run(model, ids, centroidkv, 0.25, args.new_tokens).tpot_s
    report.add(
        f"\nCentroidKV 0.25 at {length}: TPOT {tpots['auto']:.4f} s with the fused path (auto), "
        f"{tpots['sdpa']:.4f} s with SDPA + bias: {tpots['sdpa'] / tpots['auto']:.2f}x\n"
    )
    return dict(kernels=results, tpot_by_backend=tpots, length=length)


# Each section, in running order: (report, args, model) -> its record in results.json.
SECTIONS = {
    "tpot_memory": tpot_and_memory,
    "compression": compression_cost,
    "fused_attention": fused_paths,
    "throughput": throughput,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from centroidkv import load_model

    report = Report(args.out)
    report.section("environment", environment, args)
    started = time.perf_counter()
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    report.add(f"model {args.model} built in {time.perf_counter() - started:.1f} s\n")
    for title, fn in SECTIONS.items():
        if not args.only or title in args.only:
            report.section(title, fn, args, model)
    failed = [title for title, value in report.data.items() if isinstance(value, dict) and "error" in value]
    report.add(f"sections failed: {', '.join(failed) or 'none'}")
    report.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
