"""The vLLM plugin's greedy tokens against the harness's own CentroidKV on the same token ids.

    python -m centroidkv_vllm generate --json --budget 0.5 --long-chars 3000 > plugin.out   # .venv-serve
    python scripts/serve_vs_harness.py plugin.out [--dtype bfloat16]                  # .venv

Reads the plugin's `CENTROIDKV_RESULT` line (prompt ids, budget, generated tokens), runs the
harness's plan on each prompt (the full cache and CentroidKV with the plugin's settings: every head
compressed, post-RoPE similarity, budgets in entries, same g and windows) and prints, per prompt,
how many leading tokens agree with the plugin's and the harness's entries per layer at the end.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from centroidkv.methods import get_method
from centroidkv.models.loading import load_model
from centroidkv.plan.plan import Prompt, Run, run
from centroidkv_vllm.config import CentroidConfig

MODEL = Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv")) / "smollm2-135m"


def read_result(path: str) -> dict:
    for line in Path(path).read_text().splitlines():
        if line.startswith("CENTROIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise SystemExit(f"{path}: no CENTROIDKV_RESULT line")


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens on which a and b agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("result")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="also one SERVE_VS_HARNESS line of JSON")
    args = parser.parse_args()
    plugin = read_result(args.result)
    budget = plugin["budget"] or 1.0
    model, _ = load_model(str(MODEL), dtype=getattr(torch, args.dtype))
    method = CentroidConfig.from_dict(plugin["settings"]).method()  # the plugin's method, as it ran
    runs = [Run(get_method("full"), 1.0), Run(method, budget)]
    compared = []
    for ids, tokens in zip(plugin["prompt_ids"], plugin["tokens"]):
        prompt = Prompt(prefilled=ids, fed=[], context=ids, question=[])
        outcomes = run(model, prompt, runs, len(tokens), eos_token_ids=set(), budget_unit="entries")
        row = {"prompt_tokens": len(ids), "new_tokens": len(tokens)}
        for name, outcome in zip(("full", "centroidkv"), outcomes, strict=True):
            if outcome.error is not None:
                raise SystemExit(f"n={len(ids)} {name}: error {outcome.error}")
            generated = outcome.generation.tokens[0]
            row[name] = {
                "agree": agreement(generated, tokens),
                "entries": outcome.generation.seq_lengths[0],
            }
            print(
                f"n={len(ids)} harness {name} R={budget if name != 'full' else 1.0} ({args.dtype}): "
                f"agrees with the plugin on {row[name]['agree']}/{len(tokens)} tokens; entries per "
                f"layer at the end {row[name]['entries']}"
            )
        compared.append(row)
    if args.json:
        print("SERVE_VS_HARNESS " + json.dumps(compared))


if __name__ == "__main__":
    main()
