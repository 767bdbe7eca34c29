"""Serving throughput at equal KV memory: stock vLLM against the CentroidKV plugin (issue 37, item 4).

One KV pool for every row, sized to hold `--fit` full-cache requests (prompt + new tokens, in whole
blocks of 128 slots, plus vLLM's null block); more requests than that are submitted at once, all at
time 0, with decode-heavy lengths. Each row is one engine in its own process (`python -m
centroidkv_vllm workload`, the engine stepped in-process so the scheduler can be read after every
step): stock vLLM (no plugin loaded), then the plugin with its scheduler at each budget R, under
each head policy of `--heads` (`none`: every KV head compressed, R in entries; `whole`: the model's
calibrated heads kept whole in a per-request side store, R in bytes over both parts).
Every row runs in one dtype: bf16 where the CPU computes in it (AVX512-BF16 or AMX), else float32,
which such a CPU runs several times faster than vLLM's emulated bf16 (`--dtype` chooses).

Reported per row: the most requests running at once and their mean over decode steps, output
tokens/s (all output tokens over the wall time from the first step to the last), TTFT (from time 0,
queueing included; mean over requests), TPOT (per request (finish - first token) / (new tokens - 1);
mean), the KV bytes a running request holds (pool blocks in use / requests running, mean over steps
with a request running), the share of the wall time spent in steps that held prompt tokens, and
each ratio to stock vLLM. The row "plugin R=1 own attn" runs the full cache (nothing merged, equal
memory) with every decoding row through the plugin's float32 attention instead of vLLM's C++
kernel: the plugin rows' ratios to it measure the cache, not the kernel. A last reference row (not at equal memory; `--no-unlimited` skips it) runs
stock vLLM with a pool that holds every request at once: the throughput this machine gives at full
concurrency, i.e. the most that freeing KV memory could buy here. The plugin also keeps a float32 log-degree per KV head and slot beside the
pool (4 bytes per KV head, layer and slot: 1.6 % of the bf16 KV bytes at head dim 64), not in the pool.

    .venv-serve/bin/python scripts/serve_bench.py            # 16 x (2048 + 512) tokens, pool of 4
    .venv-serve/bin/python scripts/serve_bench.py --quick    # 8 x (1024 + 256) tokens, pool of 2:
                                                             # stock and R = 1/4, 1/8 (both policies)

Records: results/serve_bench-<UTC time>.json (settings, machine load, one record per row with its
measures and the raw per-step trace), a file beside the compact records, so that the README's
`rm -rf results/*/` keeps it (not committed: .gitignore).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from centroidkv_vllm import require_vllm  # noqa: E402
from centroidkv_vllm.__main__ import DEFAULT_MODEL  # noqa: E402

BLOCK = 128
ITEMSIZE = {"bfloat16": 2, "float32": 4}  # bytes of one KV cache element per --dtype
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument(
        "--quick", action="store_true", help="8 x (1024 + 256) tokens, a pool of 2; stock, R = 1/4 and 1/8"
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--fit", type=int, default=4, help="full-cache requests the KV pool holds")
    parser.add_argument("--budgets", default="0.5,0.25,0.125")
    parser.add_argument(
        "--heads", default="none,whole", help="head policies of the plugin's rows: none, whole or both"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=list(ITEMSIZE),
        help="the model's and the KV cache's dtype in every row (default: bfloat16 where the CPU has "
        "bf16 instructions, else float32, which such a CPU runs several times faster)",
    )
    parser.add_argument("--compress-interval", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--no-unlimited",
        action="store_true",
        help="skip the reference row: stock vLLM with a pool that holds every request",
    )
    parser.add_argument(
        "--no-own",
        action="store_true",
        help="skip the row of the full cache (R = 1) through the plugin's own attention",
    )
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    if not set(args.heads.split(",")) <= {"none", "whole"}:
        parser.error(f"--heads {args.heads!r}: a comma list of none and whole")
    args.dtype = args.dtype or native_dtype()
    if args.quick:
        args.requests, args.prompt_tokens, args.new_tokens, args.fit = 8, 1024, 256, 2
        args.budgets, args.no_own, args.no_unlimited = "0.25,0.125", True, True
    return args


def native_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """bfloat16 where the CPU computes in it (AVX512-BF16 or AMX-BF16), else float32."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return "float32"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def bytes_per_token(model: str, dtype: str = "bfloat16") -> int:
    """KV bytes of one token over all layers in `dtype`, from the model's config."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * ITEMSIZE[dtype] * config["num_hidden_layers"] * kv_heads * head_dim


def pool_mib(args: argparse.Namespace) -> float:
    """A pool of `fit` full-cache requests plus the null block, in MiB."""
    blocks = args.fit * math.ceil((args.prompt_tokens + args.new_tokens) / BLOCK) + 1
    return blocks * BLOCK * bytes_per_token(args.model, args.dtype) / (1 << 20)


def run_row(
    args: argparse.Namespace,
    budget: float | None,
    fit: int | None = None,
    own: bool = False,
    heads: str = "none",
) -> dict:
    """One engine in its own process; its trace (`centroidkv_vllm.workload.Trace`) as a dict.
    `fit`: a pool of that many full-cache requests instead of `args.fit`; `own`: every decoding row
    through the plugin's attention; `heads`: the plugin's head policy."""
    kv_mib = pool_mib(args) if fit is None else pool_mib(argparse.Namespace(**{**vars(args), "fit": fit}))
    command = [sys.executable, "-m", "centroidkv_vllm", "workload", "--model", args.model]
    command += ["--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens)]
    command += ["--max-tokens", str(args.new_tokens), "--kv-mib", f"{kv_mib:.4f}"]
    command += ["--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype]
    if budget is None:
        command.append("--stock")
    else:
        command += ["--budget", str(budget), "--compress-interval", str(args.compress_interval)]
        command += ["--own-attention"] if own else []
        command += ["--heads", heads]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("CENTROIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"row R={budget} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def measures(trace: dict, new_tokens: int) -> dict:
    """The table's measures from one trace."""
    steps = [i for i, running in enumerate(trace["running"]) if running > 0]
    used = [trace["num_blocks"] - 1 - trace["free_blocks"][i] for i in steps]
    per_request = [u / trace["running"][i] for u, i in zip(used, steps)]
    decode = [trace["running"][i] for i in steps if not trace["step_prefill"][i]]
    prefill_time = sum(t for t, p in zip(trace["step_seconds"], trace["step_prefill"]) if p)
    tpot = [(f - t) / max(1, new_tokens - 1) for f, t in zip(trace["finish"], trace["ttft"])]
    return {
        "max_running": max(trace["running"]),
        "mean_running_decode": statistics.fmean(decode) if decode else 0.0,
        "output_tok_s": sum(len(t) for t in trace["tokens"]) / trace["seconds"],
        "ttft_s": statistics.fmean(trace["ttft"]),
        "tpot_s": statistics.fmean(tpot),
        "kv_mib_per_request": statistics.fmean(per_request) * trace["block_bytes"] / (1 << 20),
        "prefill_share": prefill_time / trace["seconds"],
        "seconds": trace["seconds"],
        "blocks_freed_early": trace["freed_early"],
        "preemptions": trace["preemptions"],
    }


COLUMNS = [
    ("max_running", "max running", "{:.0f}"),
    ("mean_running_decode", "mean running", "{:.1f}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("ttft_s", "TTFT s", "{:.1f}"),
    ("tpot_s", "TPOT ms", "{:.0f}"),
    ("kv_mib_per_request", "KV MiB/req", "{:.1f}"),
    ("prefill_share", "prefill share", "{:.0%}"),
]
RATIOS = [
    ("max_running", "x running"),
    ("output_tok_s", "x tok/s"),
    ("ttft_s", "x TTFT"),
    ("tpot_s", "x TPOT"),
    ("kv_mib_per_request", "x KV/req"),
]


def table(rows: list[dict]) -> str:
    """Rows side by side, then each ratio to the first row (stock vLLM)."""
    stock = rows[0]["measures"]
    head = ["engine"] + [name for _, name, _ in COLUMNS] + [label for _, label in RATIOS]
    lines = [head]
    for row in rows:
        m = row["measures"]
        cells = [row["engine"]]
        for key, _, fmt in COLUMNS:
            value = m[key] * 1000 if key == "tpot_s" else m[key]
            cells.append(fmt.format(value))
        cells += [f"{m[k] / stock[k]:.2f}" if stock[k] else "-" for k, _ in RATIOS]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def row_plan(args: argparse.Namespace) -> list[tuple[float | None, bool, str]]:
    """The equal-memory rows in order, each (budget or None for stock vLLM, own attention, heads)."""
    budgets = [float(b) for b in args.budgets.split(",") if b]
    plan = [(None, False, "none"), *[(b, False, h) for b in budgets for h in args.heads.split(",")]]
    return plan + ([] if args.no_own else [(1.0, True, "none")])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    require_vllm("serve_bench.py")
    started = time.time()
    rows = []
    for budget, own, heads in row_plan(args):
        engine = "stock vLLM" if budget is None else f"plugin R={budget:g}" + (" own attn" if own else "")
        engine += " heads whole" if heads == "whole" else ""
        print(f"running {engine} ...", flush=True)
        trace = run_row(args, budget, own=own, heads=heads)
        row = {
            "engine": engine,
            "budget": budget,
            "heads": heads,
            "measures": measures(trace, args.new_tokens),
        }
        rows.append({**row, "trace": trace})
        print(json.dumps(row), flush=True)
    if not args.no_unlimited:
        engine = f"stock, pool x{args.requests / args.fit:g}"
        print(f"running {engine} (reference: not equal memory) ...", flush=True)
        trace = run_row(args, None, fit=args.requests)
        row = {"engine": engine, "budget": None, "measures": measures(trace, args.new_tokens)}
        rows.append({**row, "trace": trace})
        print(json.dumps(row), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["kv_pool_mib"] = pool_mib(args)
    record = {
        "settings": settings,
        "wall_seconds": time.time() - started,
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serve_bench-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(record))
    print(
        f"\n{table(rows)}\n\nwall {record['wall_seconds']:.0f} s, load {record['loadavg']}; records: {path}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
