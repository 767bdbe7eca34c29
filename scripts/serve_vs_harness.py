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
from tqdm import tqdm

from centroidkv.calibrate import head_file_for
from centroidkv.errors import refused_in_one_line
from centroidkv.methods import get_method
from centroidkv.models.loading import load_model
from centroidkv.plan.plan import Prompt, Run, run
from centroidkv_vllm.config import CentroidConfig

MODEL = Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv")) / "smollm2-135m"


def read_result(path: str) -> dict:
    """The plugin's result (its CENTROIDKV_RESULT line); ValueError (one line) when there is none."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("CENTROIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise ValueError(f"{path}: no CENTROIDKV_RESULT line")


def agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens on which a and b agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def write_prompts(path: str, tokenizer, documents: int, document_tokens: int, needle_length: int) -> None:
    """The comparison's prompts as token ids (the harness's tokenizer): `documents` windows of the
    essays (`centroidkv_vllm.workload.document_prompts`) and the two needle prompts of `make demo`
    (scripts/demo.py: RULER niah_single_1 and niah_single_2, test split, seed 0, chat template) with
    their answers."""
    from centroidkv.models.chat import chat_prompt_ids
    from centroidkv_vllm.workload import document_prompts
    from eval.benchmarks.ruler import generate_samples

    prompts = [
        {"name": f"essay {i + 1}", "ids": ids}
        for i, ids in enumerate(document_prompts(tokenizer, documents, document_tokens) if documents else [])
    ]
    for task in ("niah_single_1", "niah_single_2") if needle_length else ():
        sample = generate_samples(task, needle_length, tokenizer, 1, seed=0, split="test")[0]
        ids, _ = chat_prompt_ids(
            tokenizer,
            sample["input"],
            answer_prefix=sample["answer_prefix"],
            use_chat_template=sample["use_chat_template"],
        )
        prompts.append({"name": task, "ids": list(ids), "task": sample["task"], "answers": sample["answers"]})
    Path(path).write_text(json.dumps({"prompts": prompts}))
    print(f"wrote {len(prompts)} prompts ({', '.join(str(len(p['ids'])) for p in prompts)} tokens) to {path}")


def answer_of(tokenizer, prompt: dict, tokens: list[int]) -> dict:
    """A needle prompt's decoded answer and whether it holds the needle (RULER's score)."""
    from eval.benchmarks.ruler.scoring import ruler_score

    text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return {"text": text, "found": ruler_score(prompt["task"], text, prompt["answers"]) == 100}


def parse_args() -> argparse.Namespace:
    """The command line; unless it only writes prompts, `plugin` holds the plugin's result, read and
    checked before a model loads (a bad file: one line, exit status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", nargs="?", help="the plugin's output (a CENTROIDKV_RESULT line)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="also one SERVE_VS_HARNESS line of JSON")
    parser.add_argument("--write-prompts", metavar="FILE", help="write the prompts (token ids) and exit")
    parser.add_argument("--documents", type=int, default=3, help="essay prompts written")
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--needle-length", type=int, default=4096, help="the demo's needle prompts (0: none)")
    parser.add_argument("--prompts", help="the prompt file the plugin ran: needle answers compared")
    args = parser.parse_args()
    if args.write_prompts:
        return args
    if args.result is None:
        parser.error("the plugin's result file is needed (or --write-prompts)")
    with refused_in_one_line(parser):  # everything is checked before a model loads
        args.plugin = read_result(args.result)
        if args.prompts and not Path(args.prompts).is_file():
            raise ValueError(f"--prompts {args.prompts}: no such file")
    return args


def main() -> None:
    args = parse_args()
    if args.write_prompts:
        from centroidkv.models.loading import load_tokenizer

        tokenizer = load_tokenizer(str(MODEL))
        write_prompts(args.write_prompts, tokenizer, args.documents, args.document_tokens, args.needle_length)
        return
    plugin = args.plugin
    prompt_info = json.loads(Path(args.prompts).read_text())["prompts"] if args.prompts else None
    budget = plugin["budget"] or 1.0
    model, tokenizer = load_model(str(MODEL), dtype=getattr(torch, args.dtype))
    if head_file_for(str(MODEL)) is None:  # the head file the plugin reads (centroidkv_vllm.heads)
        model.centroidkv_name = MODEL.name
    config = CentroidConfig.from_dict(plugin["settings"])
    method = config.method()  # the plugin's method, as it ran
    runs = [Run(get_method("full"), 1.0), Run(method, budget)]
    compared = []
    pairs = list(zip(plugin["prompt_ids"], plugin["tokens"]))
    for index, (ids, tokens) in enumerate(tqdm(pairs, desc="prompts", unit="prompt")):
        prompt = Prompt(prefilled=ids, fed=[], context=ids, question=[])
        outcomes = run(model, prompt, runs, len(tokens), eos_token_ids=set(), budget_unit=config.budget_unit)
        row = {"prompt_tokens": len(ids), "new_tokens": len(tokens)}
        info = prompt_info[index] if prompt_info else {}
        if info.get("answers"):
            row["name"] = info["name"]
            row["plugin_answer"] = answer_of(tokenizer, info, tokens)
        for name, outcome in zip(("full", "centroidkv"), outcomes, strict=True):
            if outcome.error is not None:
                raise SystemExit(f"n={len(ids)} {name}: error {outcome.error}")
            generated = outcome.generation.tokens[0]
            row[name] = {
                "agree": agreement(generated, tokens),
                "entries": outcome.generation.seq_lengths[0],
            }
            if info.get("answers"):
                row[name]["answer"] = answer_of(tokenizer, info, generated)
            print(
                f"n={len(ids)} harness {name} R={budget if name != 'full' else 1.0} ({args.dtype}, "
                f"heads={config.heads}, budget in {config.budget_unit}): agrees with the plugin on "
                f"{row[name]['agree']}/{len(tokens)} tokens; entries per layer at the end {row[name]['entries']}"
            )
        if "plugin_answer" in row:
            print(f"  {row['name']}: plugin {row['plugin_answer']}, harness {row['centroidkv']['answer']}")
        compared.append(row)
    if args.json:
        print("SERVE_VS_HARNESS " + json.dumps(compared))


if __name__ == "__main__":
    main()
