"""Whether a method's window of recent queries alone takes a byte budget, known before the model loads.

In bytes the cache counts everything it stores (`centroidkv.cache.planner.GroupPlanner.solve_budget`): a
method that scores with the last `window_size` queries (SnapKV, PyramidKV) stores them for every query
head, whatever its budget, so at a small budget on a short prompt that window alone can take the
whole budget, and every record would then fail at its first compression.
"""

from __future__ import annotations

from centroidkv.needs import RECORDERS


def query_group(model_name: str) -> int:
    """Query heads per KV head of a model, from its configuration where that is known without loading
    it (`centroidkv.models.model_specs.known_config`); 1 when unknown (the smallest: a check built on it never
    refuses a budget that fits)."""
    from centroidkv.models.model_specs import known_config

    config = known_config(model_name) or {}
    query_heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or query_heads
    if not isinstance(query_heads, int) or not isinstance(kv_heads, int) or kv_heads <= 0:
        return 1
    return max(1, query_heads // kv_heads)


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
