"""CentroidKV as a kvpress press (baselines/presses/centroidkv_press.py) in kvpress's own pipeline.

kvpress's `pipeline("kv-press-text-generation")` with `CentroidKVPress(compression_ratio=0.75)` must do
what native CentroidKV does under the context-only protocol at the same entry budget (R = 1 - 0.75,
`budget_unit="entries"`, Gamma = 0): keep the same entries (keys, values, log-degrees, heads kept whole)
in really smaller tensors, decode with the same degree-aware logits, and give the same greedy answer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, pipeline

from centroidkv.models.loading import _embedded_dir
from centroidkv.plan.decoding import decode_forks, prefill, start_fork
from eval.text import NOISE

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("kvpress")
from baselines.presses.centroidkv_press import CentroidKVPress  # noqa: E402  (after the skip)

RATIO = 0.75
NEW_TOKENS = 6
CONTEXT = (NOISE + " ") * 6 + "The special magic number for quiet-river is: 4827361. " + (NOISE + " ") * 6
QUESTION = "What is the special magic number for quiet-river?"


def whole_of(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys and values of a layer's heads kept whole, as they are now (None: none kept whole)."""
    whole = layer.group("whole")
    return None if whole is None else (whole.keys, whole.values)


def record_logits(model, into: list[torch.Tensor]):
    return model.lm_head.register_forward_hook(
        lambda module, args, output: into.append(output[0, -1].clone())
    )


@torch.no_grad()
def same_entries(index: int, layer, native: tuple, n: int, q: int, budget: int) -> int:
    """Assert that the pipeline's cache layer holds native CentroidKV's entries (the compressed group
    and the heads kept whole); returns how many native entries are merged (degree above 1)."""
    keys, values, log_degree, whole = native
    kept = keys.shape[2]
    assert kept == budget + q, f"layer {index}: native keeps {kept}"
    assert layer.keys.shape[2] < n, f"layer {index}: the pipeline's cache was not shrunk"
    torch.testing.assert_close(layer.keys[:, :, :kept], keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.values[:, :, :kept], values, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.main.log_degree[:, :, :kept], log_degree, rtol=0, atol=1e-6)
    if whole is not None:  # heads kept whole (the paper's outlier heads): every token
        whole_keys, whole_values = whole
        assert whole_keys.shape[2] == n + q
        pipeline_whole = layer.group("whole")
        torch.testing.assert_close(pipeline_whole.keys[:, :, : n + q], whole_keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(pipeline_whole.values[:, :, : n + q], whole_values, rtol=0, atol=1e-5)
    return int((log_degree > 0).sum())


def test_kvpress_pipeline_with_the_press_keeps_native_entries_and_answer(embedded):
    model, tokenizer = embedded
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)

    # kvpress's pipeline, as a kvpress user calls it; the cache passed in is the one it fills
    cache, press_logits = DynamicCache(), []
    hook = record_logits(model, press_logits)
    try:
        answer = pipe(
            CONTEXT,
            question=QUESTION,
            press=CentroidKVPress(compression_ratio=RATIO),
            max_new_tokens=NEW_TOKENS,
            cache=cache,
        )["answer"]
    finally:
        hook.remove()

    # native CentroidKV, context-only protocol, on the pipeline's own token ids
    ids = pipe.preprocess(CONTEXT, questions=[QUESTION], answer_prefix="", max_context_length=10**9)
    context_ids, question_ids = ids["context_ids"], ids["questions_ids"][0]
    n, q = context_ids.shape[1], question_ids.shape[1]
    prefilled = prefill(model, context_ids, max_new_tokens=0)
    native_logits = []
    hook = record_logits(model, native_logits)
    try:
        fork = start_fork(model, prefilled, "centroidkv", 1 - RATIO, 0, question_ids, budget_unit="entries")
        native_layers = [
            (layer.keys, layer.values, layer.main.log_degree, whole_of(layer)) for layer in fork.cache.layers
        ]
        generation = decode_forks(model, [fork], NEW_TOKENS)[0]
    finally:
        hook.remove()

    budget = int((1 - RATIO) * n)  # kvpress's int(n * (1 - compression_ratio))
    assert budget >= 81, "the context must hold CentroidKV's protected windows at this budget"
    assert len(cache.layers) == len(native_layers) == model.config.num_hidden_layers
    merged = sum(
        same_entries(index, layer, native, n, q, budget)
        for index, (layer, native) in enumerate(zip(cache.layers, native_layers, strict=True))
    )
    assert merged > 0, "no entry was merged: the comparison would not exercise the degrees"

    # the same decoding: one logit vector per forward after the context (the question, each step)
    assert len(press_logits) == len(native_logits) == len(generation.tokens[0])
    for step, (ours, native) in enumerate(zip(press_logits, native_logits, strict=True)):
        torch.testing.assert_close(ours, native, rtol=0, atol=1e-4, msg=f"step {step}")
    assert answer == tokenizer.decode(generation.tokens[0], skip_special_tokens=True)

    # control: without the log-degrees, the first logits differ, so equal logits above mean the
    # pipeline ran the degree-aware attention
    control = prefilled.cache.fork("centroidkv", 1 - RATIO, 0, budget_unit="entries")
    for layer in control.layers:
        layer.main.log_degree = torch.zeros_like(layer.main.log_degree)
    with control.paused():
        no_degrees = model(question_ids, past_key_values=control, logits_to_keep=1).logits[0, -1]
    assert float((no_degrees - native_logits[0]).abs().max()) > 1e-3


def test_the_press_restores_the_models_attention_and_refuses_bad_input():
    stock = AutoModelForCausalLM.from_pretrained(_embedded_dir(), attn_implementation="sdpa")
    press = CentroidKVPress(compression_ratio=0.5, params={"heads": "none"})
    with press(stock):
        assert stock.config._attn_implementation == "centroidkv"
    assert stock.config._attn_implementation == "sdpa"

    with pytest.raises(ValueError, match=r"compression_ratio must be a number in \[0, 1\), got 1"):
        CentroidKVPress(compression_ratio=1)
    with pytest.raises(ValueError, match="unknown parameter"):
        CentroidKVPress(compression_ratio=0.5, params={"chunk": 64})
    filled = DynamicCache()
    filled.update(torch.zeros(1, 3, 4, 64), torch.zeros(1, 3, 4, 64), 0)
    with pytest.raises(ValueError, match="needs an empty DynamicCache"):
        press.cache_for(filled, None)
    assert press.budget == 0.5
