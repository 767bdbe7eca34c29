"""Serving throughput under a fixed KV-memory cap: how many sequences each method fits, and tokens/s.

The mechanism behind the paper's "up to 4x throughput" (measured there inside vLLM), at the Hugging
Face level: a smaller cache per sequence lets more sequences decode together in the same memory.

1. Per method, one sequence (batch 1) is prefilled and decoded to measure its peak KV bytes: the
   largest `kv_capacity_bytes()` between decode steps (the buffers a cache holds: B + g entries per
   layer for a compressed cache, the prompt + the planned new tokens for the full cache) or during the prefill, where each layer holds its whole prompt until its
   own attention has run and compressed it (all earlier layers already compressed).
2. The cap (`--cap-mib`, by default what the full cache needs for `--full-batch` sequences) divided by
   that peak is the largest batch of equal-length prompts the method fits.
3. That batch is prefilled and decoded greedily; reported: decode tokens/s (batch x steps / time,
   the first step excluded as a warm-up), TPOT, the measured peak KV bytes at that batch (never above
   the cap), and the ratio of tokens/s to the full cache.

    python scripts/bench_throughput.py                                  # the embedded model on CPU
    python scripts/bench_throughput.py --model random-llama3.1-8b --length 16384 --cap-mib 40000
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from centroidkv.errors import refused_in_one_line
from centroidkv.models.loading import EMBEDDED_MODEL, MODEL_NAMES, check_model_name

DEFAULT_RUNS = ("full:1", "centroidkv:0.5", "centroidkv:0.25", "streaming_llm:0.25")


@dataclass
class Run:
    method: str
    budget: float
    batch: int = 0
    peak_bytes_per_seq: int = 0
    peak_bytes: int = 0
    tokens_per_s: float = float("nan")
    tpot_s: float = float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from centroidkv.methods import method_names

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of {', '.join(MODEL_NAMES)}")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=80, help="decoded tokens per sequence (Gamma)")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="method:budget pairs")
    parser.add_argument(
        "--full-batch", type=int, default=4, help="cap = the full cache of this many sequences"
    )
    parser.add_argument("--cap-mib", type=float, default=None, help="KV cap in MiB (overrides --full-batch)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (on a shared CPU, 2 spinning threads can be 20x slower)",
    )
    args = parser.parse_args(argv)
    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        known = method_names()
        runs = []
        for spec in args.runs:
            name, _, budget = spec.partition(":")
            if name not in known:
                raise ValueError(f"unknown method {name!r} in --runs (known: {', '.join(known)})")
            value = float(budget or 1)
            if not 0 < value <= 1:
                raise ValueError(f"budget of {spec!r} is not a fraction in (0, 1]")
            runs.append((name, value))
        if runs[0] != ("full", 1.0):
            raise ValueError("--runs must start with full:1 (the reference of the ratios)")
        args.runs = runs
        if args.length < 256 or args.new_tokens < 3:
            raise ValueError("--length must be >= 256 and --new-tokens >= 3")
        if args.full_batch < 1 or args.max_batch < 1 or (args.cap_mib is not None and args.cap_mib <= 0):
            raise ValueError("--full-batch, --max-batch and --cap-mib must be positive")
    return args


def prompts(model, tokenizer, batch: int, length: int) -> torch.Tensor:
    """`batch` different prompts of exactly `length` tokens (noise haystack at shifted offsets)."""
    device = next(model.parameters()).device
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(3, model.config.vocab_size, (batch, length), generator=generator).to(device)
    from bench_decode import noise_prompt

    long = noise_prompt(tokenizer, length + batch)[0]
    return torch.stack([long[row : row + length] for row in range(batch)]).to(device)


@dataclass
class Decoded:
    peak_bytes: int  # KV bytes, the prefill's transient layer included
    tokens_per_s: float  # batch / TPOT
    tpot_s: float  # mean decode step, the first (warm-up) excluded
    prefill_s: float  # prefill forward, compression included


def method_for(name: str, model_name: str):
    """The method `name` with its defaults, except on a random-weight model (random-*, tiny-*):
    there CentroidKV keeps no outlier heads whole, since calibrating random weights would only
    measure noise (and, on an 8B-shaped model, take minutes before anything is timed)."""
    from centroidkv import get_method
    from centroidkv.models.loading import RANDOM_MODELS, parse_model_name

    if name == "centroidkv" and parse_model_name(model_name)[0] in RANDOM_MODELS:
        return get_method(name, heads="none")
    return get_method(name)


@torch.inference_mode()
def decode_run(model, ids: torch.Tensor, method, budget: float, new_tokens: int) -> Decoded:
    """Prefill `ids` with a (method, budget) cache (compressing layer by layer) and decode greedily.

    `method`: a Method or a registered name. Peak memory counts the buffers (`kv_capacity_bytes`):
    what the cache holds allocated, headroom for the next decoded tokens included."""
    from centroidkv import CompressedCache
    from centroidkv.plan.timing import Timer

    cache = CompressedCache(method, budget, max_new_tokens=new_tokens)
    timer = Timer(ids.device)
    with timer.span() as prefill:
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
    compressed = [layer.capacity_bytes() for layer in cache.layers]
    whole_layer = cache.full_kv_bytes() // len(cache.layers)  # one layer's keys and values of the prompt
    # While layer l runs, layers < l are compressed and l holds its whole prompt.
    prefill_peak = max(sum(compressed[:i]) + whole_layer for i in range(len(compressed)))
    peaks = [cache.kv_capacity_bytes(), prefill_peak]
    times = timed_steps(
        model, logits, cache, new_tokens - 1, timer, lambda: peaks.append(cache.kv_capacity_bytes())
    )
    tpot = sum(times[1:]) / len(times[1:])
    return Decoded(max(peaks), ids.shape[0] / tpot, tpot, prefill.seconds)


def timed_steps(model, logits, cache, steps: int, timer, after_step=lambda: None) -> list[float]:
    """`steps` greedy decode steps after the prefill's `logits`, each timed by `timer` (a
    `centroidkv.plan.timing.Timer`); `after_step()` runs after each one, outside its time."""
    token = logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        with timer.span() as step:
            token = (
                model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            )
        times.append(step.seconds)
        after_step()
    return times


def throughput_table(args: argparse.Namespace, model=None, tokenizer=None) -> list[Run]:
    from centroidkv import load_model

    if model is None:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    runs = [Run(name, budget) for name, budget in args.runs]
    one = prompts(model, tokenizer, 1, args.length)
    for run in tqdm(runs, desc="peak KV per sequence", unit="method"):
        method = method_for(run.method, args.model)
        run.peak_bytes_per_seq = decode_run(model, one, method, run.budget, args.new_tokens).peak_bytes
    cap = args.cap_mib * 2**20 if args.cap_mib else args.full_batch * runs[0].peak_bytes_per_seq
    for run in tqdm(runs, desc="decode at the largest batch", unit="method"):
        run.batch = min(args.max_batch, int(cap // run.peak_bytes_per_seq))
        if run.batch == 0:
            continue
        ids = prompts(model, tokenizer, run.batch, args.length)
        decoded = decode_run(model, ids, method_for(run.method, args.model), run.budget, args.new_tokens)
        run.peak_bytes, run.tokens_per_s, run.tpot_s = (
            decoded.peak_bytes,
            decoded.tokens_per_s,
            decoded.tpot_s,
        )
        if run.peak_bytes > cap:
            raise RuntimeError(
                f"{run.method}: batch {run.batch} used {run.peak_bytes} KV bytes > cap {cap:.0f}"
            )
    device = next(model.parameters()).device
    print(
        f"\n## Throughput under a KV cap of {cap / 2**20:.1f} MiB: {args.model} on {device} "
        f"({model.dtype}), prompts of {args.length} tokens, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads\n"
    )
    print(
        "| method | budget | peak KV / seq MiB | batch | peak KV at batch MiB | TPOT ms | decode tok/s | vs full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    full = runs[0].tokens_per_s
    for run in runs:
        print(
            f"| {run.method} | {run.budget:g} | {run.peak_bytes_per_seq / 2**20:.1f} | {run.batch} | "
            f"{run.peak_bytes / 2**20:.1f} | {run.tpot_s * 1e3:.1f} | {run.tokens_per_s:.1f} | "
            f"{run.tokens_per_s / full:.2f}x |"
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    throughput_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
