"""Budgets in bytes: every method stores R times the bytes of a full cache of n + Gamma tokens.

On the embedded SmolLM2-135M, each native method, CentroidKV with its calibrated outlier heads kept
whole, and a kvpress press that shrinks tensors, at R = 0.25 and 0.5: what the cache stores
(`kv_bytes()`: keys, values, log-degrees, positions, attention sums, whole heads) right after the
prefill compression and after every re-compression while decoding is R x the reference within 1 %.
"""

from __future__ import annotations

import pytest
import torch

from centroidkv import CompressedCache, get_method, method_names
from centroidkv.methods import method_class
from centroidkv.plan.decoding import needs_of, prefill
from eval.config import build_run_config
from eval.run_config import ConfigError
from eval.text import essay_text

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 40
INTERVAL = 8  # re-compress every 8 decoded tokens: several re-compressions within MAX_NEW
# the methods that compress entries (the full-length caches, full and KIVI, store what they see)
NATIVE = [name for name in method_names() if method_class(name).compresses and name != "kvpress"]


def full_bytes(cache: CompressedCache, n_tokens: int) -> int:
    """Bytes of a full cache of `n_tokens` tokens, from the shapes the model produced."""
    layer = cache.layers[0]
    batch, _, _, head_dim = layer.keys.shape
    n_heads = len(layer.head_lengths())
    return len(cache.layers) * 2 * batch * n_heads * n_tokens * head_dim * layer.keys.element_size()


@pytest.fixture(scope="module")
def prompt(embedded):
    _, tokenizer = embedded
    return tokenizer(essay_text(900), return_tensors="pt").input_ids[:, :1000]


@pytest.fixture(scope="module")
def shared_prefill(embedded, prompt):
    model, _ = embedded
    methods = [get_method(name, compress_interval=INTERVAL) for name in NATIVE]
    return prefill(model, prompt, MAX_NEW, needs=needs_of(methods))


@pytest.mark.parametrize("budget", [0.25, 0.5])
@pytest.mark.parametrize("name", NATIVE)
def test_every_native_method_stores_r_times_the_full_cache_after_every_compression(
    embedded, prompt, shared_prefill, name, budget
):
    model, _ = embedded
    method = get_method(name, compress_interval=INTERVAL)
    cache = shared_prefill.cache.fork(method, budget, MAX_NEW, budget_unit="bytes")
    target = budget * full_bytes(cache, prompt.shape[1] + MAX_NEW)
    assert cache.n_compressions == 1
    assert cache.kv_bytes() == pytest.approx(target, rel=0.01)
    assert cache.budget_ratio() == pytest.approx(budget, rel=0.01)
    if name == "centroidkv":  # its outlier heads are kept whole and paid for by the other heads
        assert any(layer.group("whole") is not None for layer in cache.layers)
        assert max(cache.seq_lengths()) < int(budget * (prompt.shape[1] + MAX_NEW))
    token, seen = shared_prefill.first_token, []
    with torch.inference_mode():
        for _ in range(2 * INTERVAL + 2):  # two re-compressions
            before = cache.n_compressions
            token = (
                model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            )
            if cache.n_compressions > before:
                seen.append(cache.kv_bytes())
    assert len(seen) >= 2, "the decode should have re-compressed several times"
    for stored in seen:
        assert stored == pytest.approx(target, rel=0.01)


def test_entries_keep_the_papers_accounting_and_store_more_for_centroidkv(embedded, prompt, shared_prefill):
    method = get_method("centroidkv", compress_interval=INTERVAL)
    in_bytes = shared_prefill.cache.fork(method, 0.25, MAX_NEW, budget_unit="bytes")
    in_entries = shared_prefill.cache.fork(method, 0.25, MAX_NEW, budget_unit="entries")
    assert in_entries.seq_lengths()[0] == int(0.25 * (prompt.shape[1] + MAX_NEW))
    assert in_entries.kv_bytes() > 1.05 * in_bytes.kv_bytes()  # whole heads and records on top
    streaming = get_method("streaming_llm", compress_interval=INTERVAL)  # keys and values only
    assert (
        shared_prefill.cache.fork(streaming, 0.25, MAX_NEW, budget_unit="bytes").seq_lengths()
        == shared_prefill.cache.fork(streaming, 0.25, MAX_NEW, budget_unit="entries").seq_lengths()
    )


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_a_shrinking_press_stores_r_times_the_full_cache(embedded, prompt, budget):
    pytest.importorskip("kvpress")
    model, _ = embedded
    method = get_method("kvpress", press="SnapKVPress")
    press_run = method.prefill_run(model, budget, prompt.shape[1], MAX_NEW, share_prefill=False)
    with press_run.prefill_hooks(model):
        prefilled = prefill(model, prompt, MAX_NEW)
    assert prefilled.cache.budget_ratio() == pytest.approx(budget, rel=0.01)


def test_a_byte_budget_the_whole_heads_alone_exceed_is_one_line_before_the_model_loads():
    config = {
        "model": {"name": "smollm2-135m"},
        "methods": ["centroidkv"],
        "budgets": [0.03],
        "benchmark": {"name": "toy"},
        "experiment_name": "x",
    }
    with pytest.raises(ConfigError) as raised:
        build_run_config({**config, "budget_unit": "bytes"})
    assert len(raised.value.lines) == 1
    assert "heads kept whole alone take" in raised.value.lines[0]
    assert build_run_config({**config, "budget_unit": "entries"}).budget_unit == "entries"
    with pytest.raises(ConfigError, match="budget_unit: must be one of bytes, entries"):
        build_run_config({**config, "budget_unit": "tokens"})
