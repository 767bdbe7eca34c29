"""`python -m centroidkv_vllm generate ...`: greedy generation through vLLM's own `LLM`, with or
without the plugin, printed as JSON (token ids per prompt and the wall time).

Stock vLLM: `--stock` (the engine is started with VLLM_PLUGINS naming no plugin, so CPU_ATTN is
vLLM's own); otherwise the plugin with `--budget R` and the other `CentroidConfig` settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = (
    Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv")) / "smollm2-135m"
)
REPO = Path(__file__).resolve().parent.parent

SHORT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "Explain in two sentences why the sky is blue.\n",
)


def long_prompt(chars: int) -> str:
    """A real document (this repository's design notes) cut to `chars` characters, and a question."""
    text = (REPO / "docs" / "design.md").read_text()[:chars]
    return text + "\n\nQuestion: what are the four parts of the harness? Answer:"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m centroidkv_vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy tokens of the built-in prompts, as JSON")
    gen.add_argument("--model", default=str(DEFAULT_MODEL))
    gen.add_argument("--stock", action="store_true", help="vLLM without the plugin")
    gen.add_argument("--budget", type=float, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--long-chars", type=int, default=0, help="add a long prompt of this many characters")
    gen.add_argument("--n-sink", type=int, default=16)
    gen.add_argument("--n-recent", type=int, default=64)
    gen.add_argument("--compress-interval", type=int, default=64)
    gen.add_argument("--enable-prefix-caching", action="store_true", help="(refused by the plugin)")
    gen.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="prefill chunk (chunked prefill)"
    )
    gen.add_argument("--kv-mib", type=int, default=256, help="vLLM's KV pool")
    return parser.parse_args(argv)


def make_llm(args: argparse.Namespace):
    """vLLM's `LLM` on one CPU core, bf16, eager; the plugin configured unless --stock."""
    if args.stock:
        os.environ["VLLM_PLUGINS"] = ""  # load no general plugin: vLLM's own CPU_ATTN
    from vllm import LLM

    extra = {}
    if not args.stock:
        extra = {
            "centroidkv": {
                "budget": args.budget,
                "max_new_tokens": args.max_tokens,
                "n_sink": args.n_sink,
                "n_recent": args.n_recent,
                "compress_interval": args.compress_interval,
            }
        }
    return LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_mib << 20,
        max_model_len=4096,
        max_num_seqs=8,
        seed=0,
        additional_config=extra,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    )


def generate(argv: list[str]) -> dict:
    args = parse_args(argv)
    from vllm import SamplingParams

    llm = make_llm(args)
    prompts = list(SHORT_PROMPTS) + ([long_prompt(args.long_chars)] if args.long_chars else [])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "stock": args.stock,
        "budget": None if args.stock else args.budget,
        "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "seconds": round(time.perf_counter() - start, 2),
    }


if __name__ == "__main__":
    result = generate(sys.argv[1:])
    print("CENTROIDKV_RESULT " + json.dumps(result))
