"""`python -m centroidkv_vllm generate|workload ...`: greedy generation through vLLM's own engine,
with or without the plugin.

- `generate`: the built-in prompts through `LLM.generate`, each prompt's generated text printed
  (vLLM's log kept back unless `--verbose`); with `--json` one `CENTROIDKV_RESULT {...}` line instead
  (prompt and generated token ids, texts, wall time) beside vLLM's whole log.
- `workload`: `--requests` different document prompts of `--prompt-tokens` tokens, stepped through
  the engine in this process (`centroidkv_vllm.workload`): tokens, and the scheduler's running count
  and free blocks after every step, TTFT and finish time per request.
- `profile`: the same prompts, and once every prompt is in and `--warm-steps` more have run, `--steps`
  decode steps under cProfile: milliseconds per step and the functions that took the most time
  (where a decode step's time goes, e.g. the plugin's attention against vLLM's kernel).
  `workload` and `profile` print their `CENTROIDKV_RESULT` line.
- `serve [MODEL]`: vLLM's OpenAI-compatible server with the plugin (`centroidkv_vllm.server`);
  arguments after `--` go to the server.

Stock vLLM: `--stock` (the engine is started with VLLM_PLUGINS naming no plugin, so CPU_ATTN is
vLLM's own); otherwise the plugin with `--budget R` and the other `CentroidConfig` settings, and its
scheduler (`scheduler_cls`, which frees merged blocks) unless `--keep-blocks`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from centroidkv_vllm import require_vllm
from centroidkv_vllm.config import CentroidConfig

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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--stock", action="store_true", help="vLLM without the plugin")
    parser.add_argument("--keep-blocks", action="store_true", help="the plugin without its scheduler")
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n-sink", type=int, default=CentroidConfig.n_sink)
    parser.add_argument("--n-recent", type=int, default=CentroidConfig.n_recent)
    parser.add_argument("--compress-interval", type=int, default=CentroidConfig.compress_interval)
    parser.add_argument(
        "--heads",
        choices=("none", "whole"),
        default=CentroidConfig.heads,
        help="whole: the model's calibrated heads kept whole, budget in bytes over both parts",
    )
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--own-attention", action="store_true", help="every decoding row through the plugin's attention"
    )
    parser.add_argument("--enable-prefix-caching", action="store_true", help="(refused by the plugin)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="prefill chunk (chunked prefill)"
    )
    parser.add_argument("--kv-mib", type=float, default=256, help="vLLM's KV pool, MiB")
    parser.add_argument("--dtype", default="bfloat16", help="the model's and the cache's dtype")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m centroidkv_vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy tokens of the built-in prompts, as JSON")
    add_engine_args(gen)
    gen.add_argument("--long-chars", type=int, default=0, help="add a long prompt of this many characters")
    gen.add_argument(
        "--prompt-ids",
        default=None,
        help="a JSON file {'prompts': [{'ids': [...]}, ...]} whose token ids replace the built-in prompts",
    )
    gen.add_argument("--json", action="store_true", help="one CENTROIDKV_RESULT JSON line, vLLM's log kept")
    gen.add_argument("--verbose", action="store_true", help="vLLM's log, with the texts")
    work = sub.add_parser("workload", help="document prompts stepped through the engine, as JSON")
    add_engine_args(work)
    work.add_argument("--requests", type=int, default=8)
    work.add_argument("--prompt-tokens", type=int, default=1024)
    serve = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with the plugin")
    add_engine_args(serve)
    serve.add_argument("model_path", nargs="?", help="the model folder (default: --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.set_defaults(max_tokens=256)  # the plugin's room for new tokens per request
    prof = sub.add_parser("profile", help="decode steps under cProfile: ms per step, top functions")
    add_engine_args(prof)
    prof.add_argument("--requests", type=int, default=4)
    prof.add_argument("--prompt-tokens", type=int, default=2048)
    prof.add_argument("--warm-steps", type=int, default=70, help="decode steps before profiling")
    prof.add_argument("--steps", type=int, default=60, help="decode steps profiled")
    prof.add_argument("--top", type=int, default=25, help="functions listed")
    # serve-bench's new tokens (the budget's Gamma, and room to profile) and its running limit
    prof.set_defaults(max_tokens=512, max_num_seqs=64)
    args = parser.parse_args(argv)
    if getattr(args, "model_path", None):
        args.model = args.model_path
    if args.command == "profile" and (
        min(args.steps, args.top, args.requests) < 1 or args.max_tokens <= args.warm_steps + args.steps
    ):
        parser.error("profile: --steps, --top, --requests >= 1 and --max-tokens > --warm-steps + --steps")
    return args


def plugin_settings(args: argparse.Namespace) -> dict | None:
    """The plugin's settings from the command line (None with --stock), checked: a bad one is a
    `SettingsError` (one line) before vLLM is imported or the engine starts."""
    from centroidkv_vllm.config import CentroidConfig

    if args.stock:
        return None
    settings = {
        "budget": args.budget,
        "max_new_tokens": args.max_tokens,
        "n_sink": args.n_sink,
        "n_recent": args.n_recent,
        "compress_interval": args.compress_interval,
        "own_attention": args.own_attention,
        "heads": args.heads,
    }
    CentroidConfig.from_dict(settings)
    return settings


def llm_args(args: argparse.Namespace, longest_prompt: int = 0) -> dict:
    """`LLM(...)` arguments (`centroidkv_vllm.workload.engine_args`) from the command line."""
    from centroidkv_vllm.workload import engine_args

    settings = plugin_settings(args)
    max_model_len = {
        "generate": max(4096, longest_prompt + args.max_tokens),
        "serve": getattr(args, "max_model_len", 0),
    }.get(args.command, getattr(args, "prompt_tokens", 0) + args.max_tokens)
    result = engine_args(args.model, settings, int(args.kv_mib * (1 << 20)), args.max_num_seqs, max_model_len)
    result["enable_prefix_caching"] = args.enable_prefix_caching
    result["dtype"] = args.dtype
    if args.keep_blocks:
        result.pop("scheduler_cls", None)
        result.pop("kv_transfer_config", None)  # its connector reads the released blocks off that scheduler
    if args.max_num_batched_tokens:
        result["max_num_batched_tokens"] = args.max_num_batched_tokens
    return result


def make_llm(args: argparse.Namespace, longest_prompt: int = 0):
    """vLLM's `LLM` on one CPU core, bf16, eager; the plugin configured unless --stock."""
    if args.stock:
        os.environ["VLLM_PLUGINS"] = ""  # load no general plugin: vLLM's own CPU_ATTN
    from vllm import LLM

    return LLM(**llm_args(args, longest_prompt))


def engine_of(args: argparse.Namespace) -> dict:
    """Which engine a result is from: stock vLLM, or the plugin at its budget with all of its settings
    (which `scripts/serve_vs_harness.py` gives the harness's CentroidKV)."""
    return {
        "stock": args.stock,
        "budget": None if args.stock else args.budget,
        "settings": plugin_settings(args),
    }


def generate(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    if args.prompt_ids:
        prompts = [
            {"prompt_token_ids": p["ids"]} for p in json.loads(Path(args.prompt_ids).read_text())["prompts"]
        ]
    else:
        prompts = list(SHORT_PROMPTS) + ([long_prompt(args.long_chars)] if args.long_chars else [])
    llm = make_llm(args, max(len(p["prompt_token_ids"]) for p in prompts) if args.prompt_ids else 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        **engine_of(args),
        "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "seconds": round(time.perf_counter() - start, 2),
    }


def engine_and_documents(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine in this process and the `--requests` document prompts as a `Workload`."""
    from centroidkv_vllm import workload as wl

    llm = wl.make_llm(llm_args(args), args.stock)
    prompts = wl.document_prompts(llm.get_tokenizer(), args.requests, args.prompt_tokens)
    return llm, wl.Workload(prompts, args.max_tokens)


def workload(args: argparse.Namespace) -> dict:
    from centroidkv_vllm.workload import run

    return {**engine_of(args), **vars(run(*engine_and_documents(args)))}


def profile(args: argparse.Namespace) -> dict:
    from centroidkv_vllm.workload import profile_steps

    llm, documents = engine_and_documents(args)
    return {**engine_of(args), **profile_steps(llm, documents, args.warm_steps, args.steps, args.top)}


def as_text(result: dict) -> str:
    """`generate`'s result for a reader: each prompt's generated text under a rule."""
    engine = "stock vLLM" if result["stock"] else f"CentroidKV at {result['budget']:g} of the KV"
    if not result["stock"] and result["settings"].get("heads") == "whole":
        engine += ", its heads kept whole"
    blocks = [
        f"--- prompt {index + 1} ({tokens} tokens), {engine}:\n{text.strip()}"
        for index, (tokens, text) in enumerate(zip(result["prompt_tokens"], result["texts"], strict=True))
    ]
    return "\n".join(blocks) + f"\n--- {result['seconds']} s"


def serve(args: argparse.Namespace, server_args: list[str]) -> None:
    """Replace this process by vLLM's OpenAI server with the plugin (stock vLLM with --stock)."""
    from centroidkv_vllm.server import server_argv

    if args.stock:
        os.environ["VLLM_PLUGINS"] = ""
    engine = {**llm_args(args), "served_model_name": Path(args.model).name}  # the name clients ask for
    argv = server_argv(engine, args.host, args.port, server_args)
    print("python -m centroidkv_vllm serve: " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


def main(argv: list[str]) -> tuple[dict, bool]:
    """The command's result, and whether it is printed as the JSON line (`serve` never returns)."""
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parse_args(argv[: len(argv) - len(server_args) - (1 if "--" in argv else 0)])
    plugin_settings(args)  # a bad setting: one line, before the engine starts
    require_vllm("python -m centroidkv_vllm")
    if args.command == "serve":
        serve(args, server_args)
    as_json = args.command != "generate" or args.json
    if not as_json and not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is first imported
    return {"generate": generate, "workload": workload, "profile": profile}[args.command](args), as_json


if __name__ == "__main__":
    from centroidkv_vllm.config import SettingsError

    try:
        result, as_json = main(sys.argv[1:])
    except SettingsError as error:
        print(f"python -m centroidkv_vllm: {error}", file=sys.stderr)
        sys.exit(2)
    print("CENTROIDKV_RESULT " + json.dumps(result) if as_json else as_text(result))
