"""Short prompts: a prompt too short for a method's protected windows at the budget still runs.

Rule (`centroidkv.cache.budget.fit_protected`, applied by the cache at every compression): the recent window
shrinks to what the budget leaves, then the sinks, so that the budget is kept and the method still
chooses at least one entry; `CompressedCache.protected_used()` (and every record, through the
measurements `n_sink_used` and `n_recent_used`) says what was kept. Only a budget of no entry at all is refused, with one line.
"""

from __future__ import annotations

import pytest
import torch

from centroidkv import CompressedCache, get_method
from centroidkv.cache.budget import fit_protected, protected_entries
from centroidkv.methods import method_class, method_names
from centroidkv.plan.decoding import generate_from, needs_of, prefill
from centroidkv.plan.prefill_compressor import PrefillCompressor

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 0.25
NEW_TOKENS = 4
# 150 words: what a user pastes to try the method, far shorter than CentroidKV's 81 protected tokens
# at a quarter of the budget
TEXT = (
    "The harbour town woke on the first cold morning of the autumn. Fishing boats rocked at "
    "their moorings while gulls argued over scraps on the stone quay. In the bakery on the corner, "
    "Mara pulled the first trays of bread from the oven and set them on the wooden shelves by the "
    "window. Her brother Tomas arrived late, as he always did, with a crate of apples from the "
    "orchard above the cliffs. They talked about the storm forecast for the weekend, the price of "
    "flour, and the letter from their cousin who had moved to the city to study engineering. At "
    "eight the church bell rang, and the first customers came in with wet coats and red cheeks. "
    "By noon every loaf was sold, and Mara wrote the day's takings in the blue ledger that her "
    "grandmother had started forty years before, when the bakery first opened its doors."
)
QUESTION = "Who brought the apples?"


def native_methods() -> list[str]:
    """Every registered method that compresses through the cache (not inside a prefill of its own)."""
    return [
        name
        for name in method_names()
        if method_class(name).compresses and not isinstance(get_method(name), PrefillCompressor)
    ]


def test_the_rule_shrinks_the_recent_window_then_the_sinks_and_keeps_the_budget():
    assert fit_protected(200, 16, 64, "x") == (16, 64)  # room for both: unchanged
    assert fit_protected(81, 16, 64, "x") == (16, 64)  # exactly protected_entries
    assert protected_entries(16, 64) == 81
    assert fit_protected(80, 16, 64, "x") == (16, 63)  # the recent window shrinks first
    assert fit_protected(30, 16, 64, "x") == (16, 13)
    assert fit_protected(10, 16, 64, "x") == (9, 0)  # then the sinks; one entry left to the method
    assert fit_protected(1, 16, 64, "x") == (0, 0)
    with pytest.raises(ValueError, match="^x keeps 0 entries: no room for any token; raise the budget$"):
        fit_protected(0, 16, 64, "x")


@torch.no_grad()
def test_a_150_word_prompt_at_a_quarter_runs_for_every_native_method_within_the_budget(embedded):
    model, tokenizer = embedded
    assert len(TEXT.split()) == 150
    message = [{"role": "user", "content": f"{TEXT}\n\n{QUESTION}"}]
    ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    names = native_methods()
    assert {"centroidkv", "h2o", "snapkv", "streaming_llm", "pyramidkv", "kmeans", "cam"} <= set(names)
    methods = [get_method(name) for name in names]
    prefilled = prefill(model, ids, NEW_TOKENS, needs=needs_of(methods))
    shrunk = []
    for method in methods:
        result = generate_from(model, prefilled, method, BUDGET, NEW_TOKENS, eos_token_ids=set())
        assert len(result.tokens[0]) == NEW_TOKENS, method.name
        assert result.n_compressions >= 1, method.name
        # bytes (the default unit): everything stored right after compression is at most R of a full
        # cache of the prompt and the new tokens
        assert result.kv_budget_ratio <= BUDGET + 1e-9, f"{method.name}: {result.kv_budget_ratio:.4f}"
        used = {"n_sink_used": result.n_sink_used, "n_recent_used": result.n_recent_used}
        assert used["n_sink_used"] <= method.n_sink and used["n_recent_used"] <= method.n_recent
        kept = min(result.seq_lengths)
        assert used["n_sink_used"] + used["n_recent_used"] < max(kept, 1), method.name
        if (used["n_sink_used"], used["n_recent_used"]) != (method.n_sink, method.n_recent):
            shrunk.append(method.name)
    assert "centroidkv" in shrunk  # 16 + 64 + 1 entries do not fit a quarter of this prompt


def test_the_record_of_a_short_prompt_names_the_windows_used(tiny_model):
    """B = int(0.1 * 300) = 30 < 81: n_sink 16 stays, n_recent 64 becomes 30 - 16 - 1 = 13."""
    cache = CompressedCache(get_method("centroidkv", heads="none"), 0.1, 0, budget_unit="entries")
    tiny_model(
        torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0)), past_key_values=cache
    )
    assert cache.seq_lengths() == [30] * len(cache.layers)
    assert cache.protected_used() == {"n_sink_used": 16, "n_recent_used": 13}
    fresh = CompressedCache("centroidkv", 0.1, 0)
    assert fresh.protected_used() == {"n_sink_used": None, "n_recent_used": None}


def test_a_budget_of_no_entry_is_refused_at_the_prompt_with_one_line(tiny_model):
    cache = CompressedCache(get_method("centroidkv", heads="none"), 0.001, 0, budget_unit="entries")
    with pytest.raises(ValueError, match="^centroidkv at this budget keeps 0 entries: no room for any token"):
        tiny_model(torch.arange(3, 303).unsqueeze(0), past_key_values=cache)
