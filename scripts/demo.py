"""Demo: CentroidKV beside an eviction baseline and the full cache, on two needle-in-a-haystack prompts.

One RULER prompt with a noise haystack (niah_single_1: the needle stands out) and one with an essay
haystack (niah_single_2: the needle is a sentence among sentences), test split, on the embedded model.
Each prompt is prefilled once; every method compresses a fork of that prefill to the budget (R in
bytes: everything a method stores is R times a full cache of prompt + new tokens) and decodes
greedily. Per method: the answer, the KV cache right after compression (MiB, and its measured ratio to
a full cache of the same tokens), the median decode step and, for a merging method, the mean and
largest degree of its entries (how many tokens one entry stands for).

    python scripts/demo.py                                   # 4k tokens, budget 0.25, 1 thread
    python scripts/demo.py --length 2048 --budget 0.5 --methods centroidkv snapkv
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PROMPTS = {"niah_single_1": "noise haystack", "niah_single_2": "essay haystack"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from centroidkv.methods import method_names

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--budget", type=float, default=0.25, help="R, in bytes of a full cache")
    parser.add_argument(
        "--methods", nargs="+", default=["centroidkv", "streaming_llm"], help="compared with the full cache"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="at most (RULER allows 128)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (on a shared CPU, 2 spinning threads can be 20x slower)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    known = method_names()
    problems = [f"unknown method {m!r} (known: {', '.join(known)})" for m in args.methods if m not in known]
    if not 0 < args.budget <= 1:
        problems.append(f"--budget {args.budget} is not a fraction in (0, 1]")
    if not 512 <= args.length <= 8192:
        problems.append(f"--length {args.length} must be within 512..8192 (the model's context is 8k)")
    if args.max_new_tokens < 1 or args.threads < 1:
        problems.append("--max-new-tokens and --threads must be >= 1")
    if problems:
        parser.exit(2, f"demo: error: {problems[0]}\n")
    return args


@contextmanager
def decode_step_times(model: torch.nn.Module) -> Iterator[list[float]]:
    """Collects the seconds of every one-token forward of `model` inside the block: the decode steps."""
    times: list[float] = []
    started = 0.0

    def before(module, args, kwargs) -> None:
        nonlocal started
        started = time.perf_counter()

    def after(module, args, kwargs, output) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        if ids.shape[-1] == 1:
            times.append(time.perf_counter() - started)

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield times
    finally:
        for handle in handles:
            handle.remove()


def degrees(cache) -> tuple[float, float]:
    """Mean and largest degree over the entries of the compressed heads (heads kept whole excluded)."""
    degree = torch.cat([layer.main.degrees_or_zeros().exp().flatten() for layer in cache.layers])
    return degree.mean().item(), degree.max().item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from centroidkv import get_method, load_model
    from centroidkv.models.chat import chat_prompt_ids
    from centroidkv.models.loading import EMBEDDED_MODEL
    from centroidkv.plan.decoding import generate_from, needs_of, prefill
    from centroidkv.plan.plan import warm_up
    from eval.benchmarks.ruler import generate_samples
    from eval.benchmarks.ruler.scoring import ruler_score

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(EMBEDDED_MODEL)
    methods = [get_method(name) for name in ["full", *args.methods]]
    warm_up(
        model, methods, args.budget
    )  # a process's first compression is several times slower than the next
    print(
        f"model loaded and warmed up in {time.perf_counter() - start:.0f} s; budget R = {args.budget:g} in bytes; "
        f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print("single-machine timings are noisy: TPOT is the median of one run's decode steps")

    for task, haystack in PROMPTS.items():
        sample = generate_samples(task, args.length, tokenizer, 1, seed=args.seed, split="test")[0]
        ids, _ = chat_prompt_ids(
            tokenizer,
            sample["input"],
            answer_prefix=sample["answer_prefix"],
            use_chat_template=sample["use_chat_template"],
        )
        ids = torch.tensor([ids])
        max_new = min(sample["max_new_tokens"], args.max_new_tokens)
        prefilled = prefill(model, ids, max_new, needs=needs_of(methods))
        print(
            f"\n{task} ({haystack}): {ids.shape[1]} tokens, needle {sample['answers'][0]!r}, "
            f"prefill {prefilled.seconds:.1f} s"
        )
        for method in methods:
            budget = 1.0 if method.name == "full" else args.budget
            with decode_step_times(model) as steps:
                result = generate_from(model, prefilled, method, budget, max_new)
            answer = tokenizer.decode(result.tokens[0], skip_special_tokens=True).strip()
            found = ruler_score(sample["task"], answer, sample["answers"]) == 100
            tpot = statistics.median(steps[1:] or steps) * 1e3 if steps else float("nan")
            line = (
                f"  {method.label:<12} {'found ' if found else 'MISSED'}  "
                f"KV {result.kv_bytes / 2**20:5.1f} MiB (ratio {result.kv_ratio:.3f})  "
                f"TPOT {tpot:4.0f} ms over {len(steps)} steps"
            )
            if method.merges:  # the same compression generate_from ran, to look at its degrees
                mean, largest = degrees(prefilled.cache.fork(method, budget, max_new))
                line += f"  degree mean {mean:.1f}, max {largest:.0f}"
            print(f"{line}\n    answer: {answer[:70]!r}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
