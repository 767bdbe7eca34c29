"""Full-cache RULER baseline of the embedded model: which tasks can SmolLM2-135M do at all?

For each offline RULER task, `--n` samples at `--length` tokens: chat template (user message = the
sample's input, generation prompt, then the answer prefix), greedy decoding of the task's max new
tokens with the uncompressed cache, scored with `eval.benchmarks.ruler.scoring.ruler_score`. Writes the predictions
(jsonl) and the per-task scores (json) under `--out`, and prints the table.

    python scripts/ruler_full_baseline.py --length 4096 --n 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from centroidkv.errors import refused_in_one_line
from centroidkv.models.loading import check_model_name, load_model
from centroidkv.models.model_names import EMBEDDED_MODEL
from eval.benchmarks.ruler import OFFLINE_TASKS, generate_samples
from eval.benchmarks.ruler.scoring import ruler_score
from eval.benchmarks.ruler.tasks import check_arguments
from eval.common import write_jsonl


def prompt_ids(tok, sample: dict) -> torch.Tensor:
    messages = [{"role": "user", "content": sample["input"]}]
    text = (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        + sample["answer_prefix"]
    )
    # the chat template already writes its special tokens: add none
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def stop_ids(tok) -> list[int]:
    ids = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != tok.unk_token_id)


def greedy_answer(model, tok, ids: torch.Tensor, max_new_tokens: int, stops: list[int]) -> tuple[str, float]:
    """transformers' own greedy generation from the prompt `ids`: (the answer's text, seconds)."""
    start = time.perf_counter()
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=stops[0],
    )
    seconds = time.perf_counter() - start
    return tok.decode(output[0, ids.shape[1] :], skip_special_tokens=True), seconds


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--n", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", nargs="*", default=list(OFFLINE_TASKS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/ruler_full_baseline")
    args = parser.parse_args()
    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        for task in args.tasks:
            check_arguments(task, args.length, args.n, "test")
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    model, tok = load_model(args.model, device="cpu", dtype=torch.float32)
    stops = stop_ids(tok)
    print(f"model {args.model}; stop tokens {stops}; {args.threads} thread(s)")
    records, table = [], {}
    for task in args.tasks:
        samples = generate_samples(task, args.length, tok, args.n, seed=args.seed)
        scores = []
        for s in tqdm(samples, desc=task):
            ids = prompt_ids(tok, s)
            prediction, seconds = greedy_answer(model, tok, ids, s["max_new_tokens"], stops)
            score = ruler_score(task, prediction, s["answers"])
            scores.append(score)
            records.append(
                {
                    "task": task,
                    "index": s["index"],
                    "prompt_tokens": ids.shape[1],
                    "answers": s["answers"],
                    "prediction": prediction,
                    "score": score,
                    "seconds": round(seconds, 1),
                }
            )
            write_jsonl(records, out / f"predictions_{args.length}.jsonl")
        table[task] = sum(scores) / len(scores)
        print(f"{task:18s} {table[task]:6.1f}  ({[round(x) for x in scores]})", flush=True)
    table["average"] = sum(table.values()) / len(table)
    summary = {
        "model": args.model,
        "length": args.length,
        "n": args.n,
        "seed": args.seed,
        "cache": "full",
        "scores": table,
    }
    (out / f"scores_{args.length}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n| task | score |\n|---|---|")
    for task, score in table.items():
        print(f"| {task} | {score:.1f} |")


if __name__ == "__main__":
    main()
