"""Integration on the embedded SmolLM2-135M: the cache and attention on a real model and tokenizer."""

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from centroidkv import CompressedCache, get_method
from centroidkv.models.loading import _embedded_dir
from centroidkv.plan.decoding import generate_from, prefill
from eval.text import NOISE

FILLER = NOISE + " "  # the noise sentences, ready to repeat


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids


def needle_prompt(tokenizer) -> torch.Tensor:
    context = FILLER * 12 + "The special magic number for quiet-river is: 4827361. " + FILLER * 12
    return chat_ids(tokenizer, context + "\nWhat is the special magic number for quiet-river?")


def test_budget_one_reproduces_stock_generation(embedded):
    model, tokenizer = embedded
    ids = needle_prompt(tokenizer)
    stock = AutoModelForCausalLM.from_pretrained(
        _embedded_dir(), dtype=torch.float32, attn_implementation="sdpa"
    )
    mask = torch.ones_like(ids)  # the chat template contains the pad/eos token: no padding inferred
    reference = stock.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        past_key_values=DynamicCache(),
        pad_token_id=tokenizer.eos_token_id,
    )
    cache = CompressedCache("centroidkv", budget=1.0, max_new_tokens=12)
    ours = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        past_key_values=cache,
        pad_token_id=tokenizer.eos_token_id,
    )
    assert torch.equal(ours, reference)


def test_compressed_generation_on_real_keys(embedded):
    model, tokenizer = embedded
    ids = needle_prompt(tokenizer)
    prefilled = prefill(model, ids, max_new_tokens=16)
    full = generate_from(model, prefilled, "full", 1.0, 16)
    merged = generate_from(model, prefilled, get_method("centroidkv", chunk_size=64), 0.5, 16)
    budget_len = int(0.5 * (ids.shape[1] + 16))
    assert max(merged.seq_lengths) <= budget_len + 64
    assert merged.kv_bytes < 0.6 * full.kv_bytes
    assert len(merged.tokens[0]) == 16
    # the prefill is shared and never modified by a fork
    assert prefilled.cache.seq_lengths()[0] == ids.shape[1]
    assert all(
        torch.isfinite(layer.main.log_degree).all()
        for layer in prefilled.cache.fork("centroidkv", 0.5).layers
    )


def test_question_after_compressed_context_matches_token_by_token(embedded):
    """Context-only protocol on the real model: a multi-token question step over a compressed cache."""
    model, tokenizer = embedded
    context = tokenizer(FILLER * 20, return_tensors="pt").input_ids
    question = tokenizer(
        " What colour is the sky? Answer:", add_special_tokens=False, return_tensors="pt"
    ).input_ids
    recorder = CompressedCache("full", budget=1.0)
    model(context, past_key_values=recorder)
    block = recorder.fork("centroidkv", 0.4)
    with block.paused():
        block_logits = model(question, past_key_values=block).logits
    steps = recorder.fork("centroidkv", 0.4)
    with steps.paused():
        step_logits = torch.cat(
            [model(question[:, i : i + 1], past_key_values=steps).logits for i in range(question.shape[1])],
            dim=1,
        )
    torch.testing.assert_close(block_logits, step_logits, atol=2e-4, rtol=1e-4)
