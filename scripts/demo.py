"""Demo: CentroidKV vs the full cache on the embedded model, on needle-in-a-haystack prompts.

Prints each method's answer, whether it found the needle, its cache size and its TPOT.

    python scripts/demo.py                                # 4k tokens, budgets 0.5 and 0.25, 3 prompts
    python scripts/demo.py --length 2048 --n 1 --budgets 0.25 --methods centroidkv streaming_llm
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from centroidkv.methods import method_names

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--n", type=int, default=3, help="number of prompts (needle depths spread 10-90 %%)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--methods", nargs="+", default=["centroidkv"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    known = method_names()
    problems = [f"unknown method {m!r} (known: {', '.join(known)})" for m in args.methods if m not in known]
    problems += [f"budget {b} is not a fraction in (0, 1]" for b in args.budgets if not 0 < b <= 1]
    if not 512 <= args.length <= 8192:
        problems.append(f"--length {args.length} must be within 512..8192 (the model's context is 8k)")
    if args.n < 1:
        problems.append("--n must be >= 1")
    if problems:
        parser.exit(2, f"demo: error: {problems[0]}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from centroidkv import get_method, load_model
    from centroidkv.decoding import generate_from, needs_of, prefill
    from eval.metrics import ruler_score
    from eval.ruler import generate_samples

    model, tokenizer = load_model("smollm2-135m")
    samples = generate_samples("niah_single_1", args.length, tokenizer, args.n, seed=args.seed)
    runs = [("full", 1.0)] + [(m, b) for m in args.methods for b in args.budgets]
    methods = {name: get_method(name) for name, _ in runs}
    totals = {run: [] for run in runs}
    for sample in tqdm(samples, desc="prompts", unit="prompt"):
        messages = [{"role": "user", "content": sample["input"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(
            text + sample["answer_prefix"], add_special_tokens=False, return_tensors="pt"
        ).input_ids
        max_new = sample["max_new_tokens"]
        prefilled = prefill(model, ids, max_new, needs=needs_of(methods.values()))
        print(
            f"\nprompt {sample['index']}: {ids.shape[1]} tokens, prefill {prefilled.seconds:.1f} s, "
            f"needle answer {sample['answers']}"
        )
        for name, budget in runs:
            result = generate_from(model, prefilled, methods[name], budget, max_new)
            answer = tokenizer.decode(result.tokens[0], skip_special_tokens=True).strip()
            score = ruler_score(sample["task"], answer, sample["answers"])
            totals[(name, budget)].append((score, result))
            print(
                f"  {name:>12} @ {budget:<4g} {'found' if score == 100 else 'MISSED':>6}  "
                f"KV {result.kv_bytes / 2**20:6.1f} MiB ({result.seq_lengths[0]} entries/layer)  "
                f"TPOT {result.tpot_s * 1e3:5.0f} ms  answer: {answer[:60]!r}"
            )
    print("\nsummary")
    for (name, budget), rows in totals.items():
        accuracy = sum(s for s, _ in rows) / len(rows)
        kv = sum(r.kv_bytes for _, r in rows) / len(rows) / 2**20
        tpot = sum(r.tpot_s for _, r in rows) / len(rows) * 1e3
        print(f"  {name:>12} @ {budget:<4g} accuracy {accuracy:5.1f}  KV {kv:6.1f} MiB  TPOT {tpot:5.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
