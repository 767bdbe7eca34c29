"""Hybrid attention on a real model: the degree-aware attention against transformers' own, and the
bytes a compressed cache keeps (docs/models.md).

    python scripts/check_hybrid.py [--model gemma3-270m] [--tokens 1500] [--budget 0.25]

On a prompt several windows long it prints: the largest logit difference between the model run with
the full method in a CompressedCache and the stock model (sdpa attention, DynamicCache) over the
prefill and 8 greedy decode steps, whether the greedy tokens agree, each window layer's kept entries,
and the measured bytes of a compressed cache against R times a full cache of the same model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args() -> argparse.Namespace:
    """The command line, checked before a model loads (a bad value: one line, exit status 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=4000, help="prompt tokens (several windows long)")
    parser.add_argument(
        "--budget", type=float, default=0.5, help="R; it must exceed what the window layers alone hold"
    )
    parser.add_argument("--steps", type=int, default=8, help="greedy decode steps compared")
    args = parser.parse_args()
    from centroidkv.cache.budget import check_budget
    from centroidkv.errors import refused_in_one_line
    from centroidkv.models.loading import check_model_name

    with refused_in_one_line(parser):  # everything is checked before a model loads
        check_model_name(args.model)
        check_budget(args.budget)
        if args.tokens < 2 or args.steps < 1:
            raise ValueError(f"--tokens must be >= 2 and --steps >= 1, got {args.tokens} and {args.steps}")
    return args


def main() -> None:
    args = parse_args()
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, DynamicCache

    from centroidkv import CompressedCache, get_method, load_model
    from centroidkv.cache.window_layer import sliding_windows
    from eval.text import essay_text

    model, tokenizer = load_model(args.model)
    stock = AutoModelForCausalLM.from_pretrained(
        model.config.name_or_path, dtype=model.dtype, trust_remote_code=False
    )
    stock.set_attn_implementation("sdpa")
    ids = tokenizer(essay_text(args.tokens, split="dev"), return_tensors="pt").input_ids[:, : args.tokens]
    windows = sliding_windows(model.config)
    print(
        f"{args.model}: {len(windows)} of {model.config.num_hidden_layers} layers a window of "
        f"{next(iter(windows.values()), 0)} tokens; prompt {ids.shape[1]} tokens"
    )
    ours_cache, stock_cache = CompressedCache("full", 1.0, args.steps), DynamicCache(config=stock.config)
    worst, agree, token_ours, token_stock = 0.0, True, ids, ids
    with torch.no_grad():
        for _ in range(args.steps + 1):
            ours = model(token_ours, past_key_values=ours_cache).logits[:, -1]
            reference = stock(token_stock, past_key_values=stock_cache).logits[:, -1]
            worst = max(worst, float((ours - reference).abs().max()))
            token_ours, token_stock = ours.argmax(-1, keepdim=True), reference.argmax(-1, keepdim=True)
            agree &= bool(torch.equal(token_ours, token_stock))
        print(
            f"full method vs stock sdpa: largest logit difference {worst:.2e}; greedy tokens agree: {agree}"
        )
        kept = sorted(
            {layer.main.length for index, layer in enumerate(ours_cache.layers) if index in windows}
        )
        print(f"window layers keep {kept} entries; full cache KV ratio {ours_cache.kv_ratio():.3f}")
        for name in tqdm(("centroidkv", "snapkv", "streaming_llm"), desc="methods"):
            cache = CompressedCache(get_method(name, heads="none"), args.budget, args.steps)
            try:
                model(ids, past_key_values=cache)
            except ValueError as error:  # a budget the window layers alone exceed
                print(f"{name} at R={args.budget:g}: {error}")
                continue
            print(
                f"{name} at R={args.budget:g}: stores {cache.budget_ratio():.4f} of a full cache of the same "
                f"model (window layers included); global layers keep "
                f"{[layer.main.length for index, layer in enumerate(cache.layers) if index not in windows]}"
            )


if __name__ == "__main__":
    main()
