"""The three head scores, measured on token windows a caller gives (`centroidkv.calibrate` says what
each means and keeps the files): clustering and streaming as the relative error of each KV head's
attention output, needle as the attention mass on the answer's tokens."""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm import tqdm

from centroidkv.cache.budget import DEFAULT_BUDGET_UNIT
from centroidkv.cache.cache import CompressedCache, causal_allowed
from centroidkv.calibrate import STREAMING_SINKS, check_score, worst_heads
from centroidkv.methods import get_method
from centroidkv.needs import query_window


def head_probabilities(queries: Tensor, keys: Tensor, log_degree: Tensor | None, scaling: float) -> Tensor:
    """Causal degree-aware attention probabilities of the last w queries over the cache, per query
    head: [B, Hq, w, T] float32."""
    group = queries.shape[1] // keys.shape[1]
    logits = queries.float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2) * scaling
    if log_degree is not None:
        logits = logits + log_degree.float().repeat_interleave(group, 1).unsqueeze(2)
    allowed = causal_allowed(queries.shape[2], keys.shape[2], keys.device)
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1)


def head_attention(
    queries: Tensor, keys: Tensor, values: Tensor, log_degree: Tensor | None, scaling: float
) -> Tensor:
    """Causal degree-aware attention of the last w queries, per query head: [B, Hq, w, D] float32."""
    group = queries.shape[1] // keys.shape[1]
    return head_probabilities(queries, keys, log_degree, scaling) @ values.float().repeat_interleave(group, 1)


def kv_head_energy(outputs: Tensor, n_kv_heads: int) -> Tensor:
    """[Hkv]: sum of squares of [B, Hq, w, D] over the query heads of each KV head (and B, w, D)."""
    return outputs.square().unflatten(1, (n_kv_heads, -1)).sum(dim=(0, 2, 3, 4))


def head_errors(
    model, prompts: list[Tensor], budget: float, score: str = "clustering", n_queries: int = 64
) -> Tensor:
    """[n_layers, n_kv_heads] relative L2 error of each KV head's attention output under `score`'s
    way of shrinking the cache to `budget` (see the module)."""
    if score not in ("streaming", "clustering"):
        raise ValueError(f"head_errors measures the streaming or clustering score, not {score!r}")
    with torch.inference_mode():
        return _head_errors(model, prompts, budget, score, n_queries)


def clustering_method():
    """CentroidKV with its defaults and no head policy: what the clustering score measures."""
    return get_method("centroidkv", heads="none")


def streaming_window(keys: Tensor, values: Tensor, budget: float) -> tuple[Tensor, Tensor]:
    """The streaming score's cache: the first `STREAMING_SINKS` entries and the most recent ones, for
    int(budget x T) entries in all."""
    length = keys.shape[2]
    kept = max(STREAMING_SINKS + 1, int(budget * length))
    if kept >= length:
        return keys, values
    index = torch.cat(
        [torch.arange(STREAMING_SINKS), torch.arange(length - (kept - STREAMING_SINKS), length)]
    ).to(keys.device)
    return keys[:, :, index], values[:, :, index]


def _head_errors(model, prompts: list[Tensor], budget: float, score: str, n_queries: int) -> Tensor:

    method = clustering_method() if score == "clustering" else None
    needs = [*query_window(n_queries), *(method.needs() if method else ())]
    total = None
    for ids in tqdm(prompts, desc=f"calibrating heads ({score} score)", unit="prompt"):
        full = CompressedCache("full", 1.0, 0, needs=needs)
        model(ids, past_key_values=full, logits_to_keep=1)
        compressed = full.fork(method, budget).layers if method else [None] * len(full.layers)
        rows = []
        for full_layer, layer in zip(full.layers, compressed, strict=True):
            reference, scaling = full_layer.main, full_layer.scaling
            queries = reference.windows.get("queries")
            expected = head_attention(queries, reference.keys, reference.values, None, scaling)
            if layer is None:
                keys, values = streaming_window(reference.keys, reference.values, budget)
                got = head_attention(queries, keys, values, None, scaling)
            else:
                group = layer.main
                got = head_attention(queries, group.keys, group.values, group.log_degree, scaling)
            n_kv_heads = reference.keys.shape[1]
            rows.append(
                (kv_head_energy(got - expected, n_kv_heads) / kv_head_energy(expected, n_kv_heads)).sqrt()
            )
        errors = torch.stack(rows)
        total = errors if total is None else total + errors
    return total / len(prompts)


MEASURES = {
    "needle": "attention mass of the last 32 queries on the answer's tokens in the context (retrieval heads)",
    "clustering": "relative L2 error of each KV head's attention output, clustered (CentroidKV) vs full cache",
    "streaming": f"relative L2 error of each KV head's attention output, {STREAMING_SINKS} sinks + a recent "
    "window vs full cache (DuoAttention's criterion)",
}


def needle_mass(model, prompts: list[Tensor], needles: list[Tensor], n_queries: int = 32) -> Tensor:
    """[n_layers, n_kv_heads] attention mass of the last `n_queries` queries on the positions
    `needles[i]` (1-D, the answer's tokens in the context) of `prompts[i]` ([1, T]): averaged over the
    queries, the query heads of each KV head and the prompts."""
    total = None
    with torch.inference_mode():
        for ids, positions in tqdm(
            list(zip(prompts, needles, strict=True)), desc="calibrating heads (needle score)", unit="prompt"
        ):
            full = CompressedCache("full", 1.0, 0, needs=query_window(n_queries))
            model(ids, past_key_values=full, logits_to_keep=1)
            rows = []
            for layer in full.layers:
                group = layer.main
                probabilities = head_probabilities(
                    group.windows.get("queries"), group.keys, None, layer.scaling
                )
                mass = probabilities[..., positions.to(group.keys.device)].sum(-1).mean(dim=(0, 2))  # [Hq]
                rows.append(mass.unflatten(0, (group.keys.shape[1], -1)).mean(dim=1))
            scores = torch.stack(rows)
            total = scores if total is None else total + scores
    return total / len(prompts)


def calibrate_heads(
    model,
    name: str,
    prompts: list[Tensor],
    budget: float = 0.25,
    fraction: float = 0.04,
    text: str = "",
    score: str = "clustering",
    needles: list[Tensor] | None = None,
) -> dict:
    """Measure every head's score on the token windows `prompts` ([1, T] each, on any device) and
    return the head file's content; `text` says in words what the windows are. The needle score needs
    `needles`, the answer's token positions in each prompt."""
    device = next(model.parameters()).device
    check_score(score)
    if score == "needle":
        if needles is None:
            raise ValueError("the needle score needs the answer's positions in each prompt (needles=...)")
        errors = needle_mass(model, [ids.to(device) for ids in prompts], needles)
    else:
        errors = head_errors(model, [ids.to(device) for ids in prompts], budget, score)
    data = {
        "model": name,
        "score": score,
        "budget": budget,
        "budget_unit": {"clustering": DEFAULT_BUDGET_UNIT, "streaming": "entries"}.get(score),
        "fraction": fraction,
        "n_layers": errors.shape[0],
        "n_kv_heads": errors.shape[1],
        "text": text,
        "measure": MEASURES[score],
        "errors": [[round(float(e), 6) for e in row] for row in errors],
    }
    if score == "clustering":  # the settings whose damage was measured (a run with others is warned)
        data["method"] = {k: v for k, v in clustering_method().params().items() if not k.startswith("heads")}
    data["outliers"] = [
        [layer, head] for layer, heads in worst_heads(data["errors"], fraction).items() for head in heads
    ]
    return data
