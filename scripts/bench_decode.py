"""Decode benchmark: full cache vs CentroidKV side by side, and the cost of Chunked Soft Matching.

Part 1 (embedded model, or any `--model`): for each prompt length, one prefill shared by all runs,
then full cache and CentroidKV at each budget, each decoded twice: into preallocated buffers written
in place (the default) and with the cache concatenated every step (`in_place=False`, the path before
the buffers). Reported: TTFT, TPOT, KV bytes, the TPOT ratio to the full cache, and the
memory-traffic limit (weights + R * KV) / (weights + KV) that a decode step bound by memory reads
would reach. Decoding runs long enough (`--new-tokens`, default 2 g) to include re-compressions.
A last row per length decodes with plain `model.generate` (transformers' DynamicCache and SDPA);
"vs generate" is our full-cache TPOT over its TPOT (target <= 1.05).

Part 2: decode step time per storage precision (`centroidkv.cache.quantization`): the full cache decoded
alone (one fork, as `decode_batch=1`) in the model's dtype, bf16, fp16 and KIVI's int8 / int4 / int2
codes, at `--precision-lengths` (4k and 8k), so the cost of dequantizing each step is visible beside
the bytes it saves.

Part 3: time of one CSM round vs sequence length (8 KV heads, head_dim 128 by default) with the
log-log slope, next to all-pairs bipartite matching (every A against every B, ToMe-style).

    python scripts/bench_decode.py                      # the full table (a few minutes on 2 cores)
    python scripts/bench_decode.py --lengths 1024 --csm-lengths 4096 8192   # quick look
    python scripts/bench_decode.py --skip-decode --skip-csm --new-tokens 16   # precisions only
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from centroidkv.cache.quantization import PRECISIONS
from centroidkv.csm import csm_round
from centroidkv.errors import refused_in_one_line
from centroidkv.methods import LayerKV
from centroidkv.models.loading import EMBEDDED_MODEL, MODEL_NAMES, check_model_name
from eval.text import NOISE

FILLER = NOISE + " "  # the noise sentences, ready to repeat


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of {', '.join(MODEL_NAMES)}")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--csm-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--all-pairs-max", type=int, default=16384, help="longest n for all-pairs matching")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-csm", action="store_true")
    parser.add_argument("--precision-lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), help=", ".join(PRECISIONS))
    parser.add_argument("--skip-precision", action="store_true")
    args = parser.parse_args(argv)
    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        unknown = sorted(set(args.precisions) - set(PRECISIONS))
        if unknown:
            raise ValueError(
                f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}"
            )
        if any(n < 256 for n in args.lengths + args.csm_lengths + args.precision_lengths):
            raise ValueError("lengths must be >= 256 tokens")
        if any(not 0 < b <= 1 for b in args.budgets):
            raise ValueError("budgets must be fractions in (0, 1]")
        if args.new_tokens < 2:
            raise ValueError("--new-tokens must be >= 2 (the first step is a warm-up)")
    return args


def noise_prompt(tokenizer, length: int) -> torch.Tensor:
    """A prompt of exactly `length` tokens of RULER's noise haystack."""
    ids = tokenizer(FILLER * (length // 10), add_special_tokens=False).input_ids
    if len(ids) < length:
        raise ValueError(f"noise text too short for {length} tokens")
    return torch.tensor([ids[:length]])


def generate_tpot(model, ids: torch.Tensor, new_tokens: int) -> float:
    """TPOT of plain `model.generate` (DynamicCache, SDPA): mean decode step after the first, timed
    by a logits processor that is called once per step."""
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                past_key_values=DynamicCache(),
                logits_processor=LogitsProcessorList([Stamp()]),
                pad_token_id=0,
            )
    finally:
        model.set_attn_implementation(previous)
    steps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    timed = steps[1:] or steps  # the first decode step is a warm-up, as in generate_from
    return sum(timed) / len(timed)


def decode_table(args: argparse.Namespace) -> None:
    from centroidkv import get_method, load_model
    from centroidkv.plan.decoding import decode_forks, prefill, start_fork

    model, tokenizer = load_model(args.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device = next(model.parameters()).device
    print(
        f"\n## Decode: {args.model} on {device}, {torch.get_num_threads()} threads, "
        f"{args.new_tokens} new tokens, weights {weight_bytes / 2**20:.0f} MiB\n"
    )
    header = (
        "| n | method | budget | decode | TTFT s | compress s | TPOT ms | KV MiB | KV capacity MiB "
        "| TPOT ratio | traffic limit | vs generate |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for length in tqdm(args.lengths, desc="decode", unit="length"):
        if tokenizer is None:
            ids = torch.randint(3, model.config.vocab_size, (1, length))
        else:
            ids = noise_prompt(tokenizer, length)
        ids = ids.to(device)
        prefilled = prefill(model, ids, args.new_tokens)
        full_tpot: dict[bool, float] = {}
        full_kv = None
        for name, budget in [("full", 1.0)] + [("centroidkv", b) for b in args.budgets]:
            for in_place in (False, True):
                prefilled.cache.in_place = in_place  # forks decode the way their source says
                fork = start_fork(model, prefilled, get_method(name), budget, args.new_tokens)
                result = decode_forks(model, [fork], args.new_tokens, eos_token_ids=set())[0]
                capacity = fork.cache.kv_capacity_bytes()  # behind kv_bytes_final, headroom included
                if name == "full":
                    full_tpot[in_place] = result.tpot
                    # the full cache's size over the whole run, to compare with R * (n + Gamma)
                    full_kv = (
                        result.kv_bytes_final
                        * (length + args.new_tokens)
                        / (length + len(result.tokens[0]) - 1)
                    )
                limit = (weight_bytes + budget * full_kv) / (weight_bytes + full_kv)
                print(
                    f"| {length} | {name} | {budget:g} | {'in place' if in_place else 'concat'} | "
                    f"{result.ttft:.2f} | {result.compress_s:.3f} | {result.tpot * 1e3:.1f} | "
                    f"{result.kv_bytes_final / 2**20:.1f} | {capacity / 2**20:.1f} | "
                    f"{result.tpot / full_tpot[in_place]:.3f} | {limit:.3f} | |",
                    flush=True,
                )
        reference = generate_tpot(model, ids, args.new_tokens)
        print(
            f"| {length} | model.generate | 1 | DynamicCache | | | {reference * 1e3:.1f} | | | | | "
            f"{full_tpot[True] / reference:.3f} (concat {full_tpot[False] / reference:.3f}) |",
            flush=True,
        )
        print(f"| {length} | (prefill) | | | {prefilled.seconds:.2f} | | | | | | | |", flush=True)


def precision_table(args: argparse.Namespace) -> None:
    """Part 2: TPOT of the full cache alone at each storage precision, one prefill per length."""
    from centroidkv import get_method, load_model
    from centroidkv.plan.decoding import generate_from, prefill

    model, tokenizer = load_model(args.model)
    device = next(model.parameters()).device
    print(
        f"\n## Decode per storage precision: {args.model} ({next(model.parameters()).dtype}) on {device}, "
        f"{torch.get_num_threads()} threads, full cache decoded alone, {args.new_tokens} new tokens\n"
    )
    print("| n | precision | TPOT ms | TPOT ratio | KV MiB | KV ratio | allocated ratio |")
    print("|---|---|---|---|---|---|---|")
    for length in tqdm(args.precision_lengths, desc="precision", unit="length"):
        if tokenizer is None:
            ids = torch.randint(3, model.config.vocab_size, (1, length))
        else:
            ids = noise_prompt(tokenizer, length)
        prefilled = prefill(model, ids.to(device), args.new_tokens)
        model_tpot = None
        for precision in args.precisions:
            method = get_method("full", kv_precision=precision)
            result = generate_from(model, prefilled, method, 1.0, args.new_tokens, eos_token_ids=set())
            model_tpot = result.tpot if model_tpot is None else model_tpot
            print(
                f"| {length} | {precision} | {result.tpot * 1e3:.1f} | {result.tpot / model_tpot:.2f} | "
                f"{result.kv_bytes / 2**20:.1f} | {result.kv_budget_ratio:.3f} | {result.kv_allocated_ratio:.3f} |",
                flush=True,
            )


def all_pairs_matching(keys: torch.Tensor, n_merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bipartite soft matching over the whole sequence (A = even, B = odd, every pair compared)."""
    normed = F.normalize(keys.float(), dim=-1)
    set_a, set_b = normed[:, :, 0::2], normed[:, :, 1::2]
    best_score, best_b = (set_a @ set_b.transpose(-1, -2)).max(dim=-1)
    top_a = best_score.topk(n_merge, dim=-1).indices
    return 2 * top_a, 2 * best_b.gather(-1, top_a) + 1


def best_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def csm_table(args: argparse.Namespace) -> None:
    print(
        f"\n## One matching round: {args.kv_heads} KV heads, head_dim {args.head_dim}, chunk 256, "
        f"merging n/4 tokens, {torch.get_num_threads()} threads\n"
    )
    print("| n | CSM round ms | all-pairs matching ms | all-pairs / CSM |")
    print("|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    points = []
    for n in tqdm(args.csm_lengths, desc="CSM", unit="length"):
        keys = torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen)
        kv = LayerKV(keys, torch.randn_like(keys), torch.zeros(1, args.kv_heads, n))
        csm_s = best_time(lambda kv=kv, n=n: csm_round(kv, n // 4, 256))
        points.append((n, csm_s))
        if n <= args.all_pairs_max:
            pairs_s = best_time(lambda keys=keys, n=n: all_pairs_matching(keys, n // 4), repeats=1)
            print(f"| {n} | {csm_s * 1e3:.1f} | {pairs_s * 1e3:.1f} | {pairs_s / csm_s:.1f}x |", flush=True)
        else:
            print(f"| {n} | {csm_s * 1e3:.1f} | (skipped: > --all-pairs-max) | |", flush=True)
    if len(points) >= 2:
        xs = [math.log(n) for n, _ in points]
        ys = [math.log(s) for _, s in points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        print(f"\nlog-log slope of CSM time vs n: {slope:.2f} (1.0 = linear; all-pairs is 2.0)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.skip_csm:
        csm_table(args)
    if not args.skip_decode:
        decode_table(args)
    if not args.skip_precision:
        precision_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
