"""Compression time of CentroidKV configurations as a share of the prefill, at one length (8k).

One essay prompt of `--length` tokens, one shared prefill (recording what every configuration needs),
then each (configuration, budget) forks and compresses it `--repeats` times (the median is kept).
Prints the compression time, its ratio to the prefill time and to the first configuration's (the
first default, post-RoPE, no heads, chunk 256, constant r; configurations are interleaved, so a shared
machine slows them alike) and the effective KV ratio (bytes stored / full-cache bytes); the library's
current default is marked. The defaults' criterion: compression <= 5 % of the prefill at 8k.

    python scripts/bench_centroidkv_configs.py --length 8192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from centroidkv import get_method, load_model  # noqa: E402
from centroidkv.cache.budget import check_budget  # noqa: E402
from centroidkv.errors import refused_in_one_line  # noqa: E402
from centroidkv.models.loading import EMBEDDED_MODEL  # noqa: E402
from centroidkv.plan.decoding import needs_of, prefill  # noqa: E402
from eval.text import essay_text  # noqa: E402

POST, PRE = {"similarity": "post_rope"}, {"similarity": "pre_rope"}
NONE, WHOLE = {"heads": "none"}, {"heads": "whole"}
CONST, ADAPTIVE = {"schedule": "linear", "delta_r": 0.0}, {"schedule": "adaptive"}
# every axis spelled out, so that a change of the library's defaults cannot relabel a row
CONFIGS = [
    POST | NONE | {"chunk_size": 256} | CONST,  # the first default: the reference of the ratios
    POST | NONE | {"chunk_size": 256} | ADAPTIVE,
    POST | WHOLE | {"chunk_size": 64} | CONST,
    POST | WHOLE | {"chunk_size": 256} | CONST,
    POST | WHOLE | {"chunk_size": 64} | ADAPTIVE,
    PRE | NONE | {"chunk_size": 64} | CONST,
    PRE | WHOLE | {"chunk_size": 256} | CONST,
    PRE | WHOLE | {"chunk_size": 256} | ADAPTIVE,
    POST | NONE | {"chunk_size": 256, "schedule": "linear", "r_init": 1.0, "delta_r": 0.2, "r_min": 0.3},
]


def label(params: dict) -> str:
    """e.g. pre-out-c256-adapt (similarity, heads kept whole or none, chunk size, schedule)."""
    schedule = {"adaptive": "adapt"}.get(params["schedule"], "const")
    if params.get("delta_r"):
        schedule = f"anneal (r {params['r_init']} - {params['delta_r']} j, floor {params['r_min']})"
    heads = "out" if params["heads"] == "whole" else "none"
    return f"{params['similarity'].split('_')[0]}-{heads}-c{params['chunk_size']}-{schedule}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budgets", default="0.25,0.5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with refused_in_one_line(parser):  # everything is checked before a model loads
        budgets = [check_budget(float(b)) for b in args.budgets.split(",")]
        if args.length < 2 or args.repeats < 1 or args.threads < 1:
            raise ValueError("--length must be >= 2, --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(EMBEDDED_MODEL)
    ids = tokenizer(essay_text(args.length), return_tensors="pt").input_ids[:, : args.length]
    methods = {label(params): get_method("centroidkv", **params) for params in CONFIGS}
    default = repr(get_method("centroidkv"))
    methods = {
        f"{name} (default)" if repr(method) == default else name: method for name, method in methods.items()
    }
    prefilled = prefill(model, ids, 0, needs=needs_of(methods.values()))
    print(f"{ids.shape[1]} tokens, prefill {prefilled.seconds:.2f} s, {args.threads} threads\n")
    times: dict[tuple[str, float], list[float]] = {}
    ratios: dict[tuple[str, float], float] = {}
    # configurations interleaved, so a busy machine slows them alike
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, method in methods.items():
            for budget in budgets:
                start = time.perf_counter()
                cache = prefilled.cache.fork(method, budget)
                times.setdefault((name, budget), []).append(time.perf_counter() - start)
                ratios[(name, budget)] = cache.kv_ratio()
    reference = {b: statistics.median(times[(next(iter(methods)), b)]) for b in budgets}
    print(f"| configuration | budget | compress s | / prefill | / {next(iter(methods))} | KV ratio |")
    print("|---|---|---|---|---|---|")
    for (name, budget), measured in times.items():
        seconds = statistics.median(measured)
        print(
            f"| {name} | {budget} | {seconds:.3f} | {100 * seconds / prefilled.seconds:.1f} % | "
            f"{seconds / reference[budget]:.2f} | {ratios[(name, budget)]:.3f} |"
        )


if __name__ == "__main__":
    main()
