"""Prefill sharing: what N methods on one sample cost through the runner's shared prefill.

    python scripts/prefill_sharing.py [--model smollm2-135m] [--length 4096] [--budget 0.5]

Prints one JSON object (`measure_prefill_sharing`); docs/results.md "Prefill sharing" reports it.
"""

from __future__ import annotations

import argparse
import json

import torch

from centroidkv.cache.budget import check_budget
from centroidkv.errors import refused_in_one_line
from centroidkv.methods import check_method_names, method_names
from centroidkv.models.loading import EMBEDDED_MODEL, check_model_name
from centroidkv.plan.timing import Timer
from eval.benchmarks.ruler.tasks import MIN_LENGTH


def measure_prefill_sharing(
    model_name: str = EMBEDDED_MODEL,
    length: int = 4096,
    task: str = "niah_single_1",
    budget: float = 0.5,
    methods: tuple[str, ...] | None = None,
    max_new_tokens: int = 32,
) -> dict:
    """Cost of N methods on one sample through the shared prefill, against one prefill + N decodes.

    shared_s: wall time of the runner's `run_sample` for all N methods (recording prefill, forks,
    compressions, decodes, scoring). reference_s: one plain prefill (full cache, nothing recorded)
    + the N decode loops (decode_only) or + the N compress-and-decode parts (with_compress).
    separate_s: what N independent runs would cost (N plain prefills + the same N parts).
    """
    from centroidkv import CompressedCache, load_model
    from eval.benchmarks.ruler import Ruler
    from eval.evaluate import Evaluator
    from eval.run_config import MethodSpec
    from eval.samples import encode_prompt

    model, tokenizer = load_model(model_name)
    methods = tuple(method_names()) if methods is None else methods  # default: every registered method
    specs = tuple(MethodSpec(m, 1.0 if m == "full" else budget) for m in methods)
    bench = Ruler(tasks=(task,), lengths=(length,), n_samples=1)
    sample = bench.samples(tokenizer)[0]
    evaluator = Evaluator(model, tokenizer, specs, bench, decode_batch=1)  # each fork's decode timed alone
    evaluator.warm_up()
    head, _ = encode_prompt(sample, tokenizer, context_only=False)
    timer = Timer(model.device)
    with torch.inference_mode(), timer.span() as plain:
        model(
            torch.tensor([head], device=model.device),
            past_key_values=CompressedCache("full", 1.0, max_new_tokens),
            logits_to_keep=1,
        )
    with timer.span() as shared:
        records = evaluator.run_sample(sample, list(specs), max_new_tokens)
    failed = [r["method"] for r in records if r["status"] != "ok"]
    ok = [r for r in records if r["status"] == "ok"]
    decode = sum(r["decode_s"] or 0.0 for r in ok)  # None: the answer ended after its first token
    compress = sum(r["compress_s"] for r in ok)
    return dict(
        model=model_name,
        context_length=len(head),
        n_methods=len(specs),
        failed=failed,
        plain_prefill_s=plain.seconds,
        recording_prefill_s=ok[0]["prefill_s"] if ok else None,
        decode_s=decode,
        compress_s=compress,
        compress_s_by_method={r["method"]: round(r["compress_s"], 3) for r in ok},
        shared_s=shared.seconds,
        ratio_decode_only=shared.seconds / (plain.seconds + decode),
        ratio_with_compress=shared.seconds / (plain.seconds + decode + compress),
        separate_s=len(specs) * plain.seconds + decode + compress,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure prefill sharing: N methods on one sample.")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--methods", default=None, help="comma-separated names; default: every registered method"
    )
    args = parser.parse_args(argv)
    methods = tuple(args.methods.split(",")) if args.methods else None
    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        check_budget(args.budget)
        check_method_names(methods or (), "--methods")
        if args.length < MIN_LENGTH:
            raise ValueError(
                f"--length must be at least {MIN_LENGTH} tokens (a RULER prompt), got {args.length}"
            )
        if args.max_new_tokens < 2:
            raise ValueError(
                f"--max-new-tokens must be at least 2 (a decode step to time), got {args.max_new_tokens}"
            )
    result = measure_prefill_sharing(
        args.model, args.length, budget=args.budget, methods=methods, max_new_tokens=args.max_new_tokens
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
