"""Look at RULER samples: `python -m eval.benchmarks.ruler --task niah_multikey_1 --length 4096 --tokenizer smollm2-135m --n 2`.

Prints each sample (input shortened unless --full) with its token counts; --out writes them as jsonl.
Bad arguments end with one error line and exit status 2, before any tokenizer is loaded.
"""

from __future__ import annotations

import argparse
import sys
import time

from centroidkv.models.model_names import EMBEDDED_MODEL
from eval.benchmarks import SPLITS
from eval.benchmarks.ruler.constants import TASK_NAMES
from eval.benchmarks.ruler.tasks import check_arguments, generate_samples
from eval.common import write_jsonl


def _shorten(text: str, keep: int) -> str:
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters ...]\n{text[-keep:]}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        self.exit(2, f"error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m eval.benchmarks.ruler", description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(TASK_NAMES)}")
    parser.add_argument("--length", required=True, type=int, help="target length in tokens, e.g. 4096")
    parser.add_argument("--tokenizer", default=EMBEDDED_MODEL, help="a centroidkv model name")
    parser.add_argument("--n", type=int, default=1, help="number of samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--split", choices=SPLITS, default="test", help="dev (choosing settings) or test (reported)"
    )
    parser.add_argument("--full", action="store_true", help="print whole inputs")
    parser.add_argument("--out", help="also write the samples to this jsonl file")
    args = parser.parse_args(argv)
    try:
        check_arguments(args.task, args.length, args.n, args.split)
        from centroidkv.models.loading import check_model_name  # names only: no tokenizer is loaded here

        check_model_name(args.tokenizer)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    start = time.perf_counter()
    try:
        samples = generate_samples(
            args.task, args.length, args.tokenizer, args.n, args.seed, progress=True, split=args.split
        )
    except (RuntimeError, ValueError) as error:  # hub unreachable (qa), unknown tokenizer...
        print(f"error: {error}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    for s in samples:
        print(f"===== {s['task']} #{s['index']} ({s['split']} split, seed {s['seed']}) =====")
        print(_shorten(s["input"], 10**9 if args.full else 600))
        print(f"--- answer prefix: {s['answer_prefix']!r}")
        print(f"--- answers: {s['answers']}")
        print(
            f"--- tokens: input {s['length']}, input + answer prefix + {s['max_new_tokens']} new tokens "
            f"{s['ruler_length']} / target {s['target_length']} ({100 * s['ruler_length'] / s['target_length']:.1f} %)"
        )
    print(f"{len(samples)} sample(s) in {elapsed:.1f} s")
    if args.out:
        print(f"written to {write_jsonl(samples, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
