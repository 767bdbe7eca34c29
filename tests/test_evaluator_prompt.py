"""Evaluator.prompt tokenizes a sample once unless a run compresses inside its prefill (the only runs
that read the context-only split), and the plan refuses such a run without that split."""

from __future__ import annotations

import pytest

import eval.samples as samples
from centroidkv import load_model, load_tokenizer
from centroidkv.plan.plan import Prompt, Run, run
from eval.benchmarks.toy import Toy
from eval.evaluate import Evaluator
from eval.run_config import MethodSpec


class _CompressesInPrefill:
    """Enough of a `PrefillCompressor` for the plan to recognise one (it never gets to run)."""

    name = "in-prefill"

    def prefill_run(self, model, budget, context_len, max_new_tokens, share_prefill):
        raise AssertionError("the plan must refuse before asking for a run")


def test_a_full_prompt_sample_is_tokenized_once_and_a_prefill_compressor_needs_the_split(monkeypatch):
    model, tokenizer = load_model("tiny-llama")[0], load_tokenizer("smollm2-135m")
    specs = [MethodSpec("full", 1.0), MethodSpec("snapkv", 0.5)]
    benchmark = Toy(lengths=(256,), n_samples=1)
    assert not benchmark.context_only  # a full-prompt benchmark: two splits exist
    evaluator = Evaluator(model, tokenizer, tuple(specs), benchmark)
    sample = benchmark.samples(tokenizer)[0]
    texts, splits = [], []
    chat_text, split_ids = samples.chat_text, samples.split_ids

    def render(*args, **kwargs):
        texts.append(args)
        return chat_text(*args, **kwargs)

    def split(tokenizer, text, question):
        splits.append(question)
        return split_ids(tokenizer, text, question)

    monkeypatch.setattr(samples, "chat_text", render)
    monkeypatch.setattr(samples, "split_ids", split)
    records = evaluator.run_sample(sample, specs, 8)
    assert len(texts) == 1 and splits == [None]  # rendered once, tokenized whole, no context split
    assert [r["status"] for r in records] == ["ok", "ok"]
    prompt = evaluator.prompt(sample)
    assert prompt.context == [] and len(prompt.prefilled) > 200
    with pytest.raises(ValueError, match="needs the prompt's context"):
        run(model, Prompt(prompt.prefilled, [], [], []), [Run(_CompressesInPrefill(), 0.5)], 4)
