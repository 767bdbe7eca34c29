"""A warm-up (`centroidkv.plan.plan.warm_up`) runs each method at the caller's budget and never fails a
run: on a hybrid model whose window layers alone hold more than half the bytes of the 256-token
warm-up prompt, a budget of 0.5 cannot be met there, yet `generate` at a budget the real prompt can
meet answers every method. A tiny random Gemma 3 built here, with the embedded tokenizer's vocabulary."""

from __future__ import annotations

import pytest
import torch
from test_hybrid_attention import tiny_gemma3
from transformers import Gemma3ForCausalLM

from centroidkv import get_method, prepare_model
from centroidkv.models.loading import load_tokenizer
from centroidkv.plan.generate import generate
from centroidkv.plan.plan import warm_up

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 200  # three window layers of 199 entries against one full layer: 70% of a 256-token cache


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hybrid(tokenizer) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = tiny_gemma3(vocab_size=len(tokenizer), sliding_window=WINDOW, max_position_embeddings=2048)
    model.eval().set_attn_implementation("eager")
    return prepare_model(model)


def test_a_method_that_cannot_run_on_the_warm_up_prompt_is_not_warmed_and_nothing_fails(hybrid):
    """streaming_llm at 0.5 cannot be met on 256 tokens (the window layers hold 70%): no error."""
    assert warm_up(hybrid, [get_method("streaming_llm")]) >= 0
    assert warm_up(hybrid, ["full", "streaming_llm"], budget=0.3) >= 0


def test_generate_answers_every_method_at_a_budget_the_warm_up_prompt_cannot_meet_at_half(hybrid, tokenizer):
    """The issue's case: `full` and `streaming_llm` at 0.9 on a prompt of about 600 tokens, where the
    window layers hold about half the bytes; the warm-up ran them at 0.5 and failed the call."""
    context = " ".join(f"Line {i} says the grass is green." for i in range(80))
    answers = generate(hybrid, tokenizer, context, "What colour?", ["full", "streaming_llm"], 0.9, 4)
    assert [answer.error for answer in answers] == [None, None]
    assert answers[1].kv_bytes < answers[0].kv_bytes  # it compressed (the question and answer come on top)
