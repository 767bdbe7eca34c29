"""Whether a method's window of recent queries alone takes a byte budget, known before the model loads.

In bytes the cache counts everything it stores (`CompressedCache.plan_budget`): a method that scores
with the last `window_size` queries (SnapKV, PyramidKV) stores them for every query head, whatever its
budget, so at a small budget on a short prompt that window alone can take the whole budget, and every
record would then fail at its first compression.
"""

from __future__ import annotations

from centroidkv.model_names import EMBEDDED_MODEL, TINY_MODELS, parse_model_name
from centroidkv.needs import RECORDERS

EMBEDDED_QUERY_GROUP = 3  # SmolLM2-135M: 9 query heads per 3 KV heads (its config.json)


def query_group(model_name: str) -> int:
    """Query heads per KV head of a named model, known without loading it; 1 when unknown (the
    smallest: a check built on it never refuses a budget that fits)."""
    from centroidkv.model_specs import PAPER_CONFIGS, tiny_config

    base, _ = parse_model_name(model_name)
    if base == EMBEDDED_MODEL:
        return EMBEDDED_QUERY_GROUP
    if base in PAPER_CONFIGS:
        values = PAPER_CONFIGS[base][2]
        return values["num_attention_heads"] // values["num_key_value_heads"]
    if base in TINY_MODELS:
        config = tiny_config(base)
        return config.num_attention_heads // config.num_key_value_heads
    return 1


def window_budget_error(method, model_name: str, budget: float, full_len: int) -> str | None:
    """Why `method`'s query window alone takes `budget` of a full cache of `full_len` tokens in the
    model's dtype (a key and a value per KV head per token; the window holds one query per query
    head per row), or None when it leaves room."""
    window = sum(need.window for need in method.needs() if RECORDERS[need.name].window)
    if not window:
        return None
    group = query_group(model_name)
    share = group * window / (2 * full_len)
    if share < budget:
        return None
    return (
        f"its window of the last {window} queries (window_size) alone takes {share:.1%} of a full cache's "
        f"bytes at {full_len} tokens ({group} query heads per KV head), not less than the budget {budget:g}; "
        "raise the budget, lower window_size or use budget_unit=entries"
    )
