"""A sample's identity and its prompt as token ids (chat template, answer prefix, context/question split)."""

from __future__ import annotations

from centroidkv.models.chat import chat_text, split_ids
from centroidkv.plan.plan import CONTEXT_ONLY, FULL_PROMPT, Prompt
from eval.benchmarks import Sample


def sample_id(sample: Sample) -> str:
    parts = [
        sample.get("task"),
        sample.get("length"),
        sample.get("depth"),
        sample.get("index", sample.get("_id")),
    ]
    return "-".join(str(p) for p in parts if p is not None)


def encode_prompt(sample: Sample, tokenizer, context_only: bool) -> tuple[list[int], list[int]]:
    """Token ids of the prompt as (prefilled part, fed-after-compression part).

    The chat template wraps the user message (RULER: always; LongBench: per `use_chat_template`),
    then the answer prefix follows. With `context_only` the question (and everything after it) is
    the second part, fed uncompressed after the context has been compressed.
    """
    return split_ids(
        tokenizer, _chat_text(sample, tokenizer), sample.get("question") if context_only else None
    )


def sample_prompt(
    sample: Sample, tokenizer, context_only: bool, split_context: bool, vocab_size: int
) -> Prompt:
    """The sample's prompt as the plan runs it, its text rendered once (as `encode_prompt` renders it):
    (prefilled, fed) under the benchmark's protocol (`context_only` or the full prompt), and the
    context-only split (context, question) when the protocol is context-only (then the same) or
    `split_context` (runs that compress inside their prefill read it; empty otherwise). The ids are
    folded into `vocab_size` (a tiny test model has 512 tokens, fewer than the tokenizer)."""
    text = _chat_text(sample, tokenizer)
    needs_context = context_only or split_context
    context = split_ids(tokenizer, text, sample.get("question")) if needs_context else ([], [])
    prefilled, fed = context if context_only else split_ids(tokenizer, text, None)
    folded = [[t % vocab_size for t in ids] for ids in (prefilled, fed, *context)]
    return Prompt(*folded, protocol=CONTEXT_ONLY if context_only else FULL_PROMPT)


def _chat_text(sample: Sample, tokenizer) -> str:
    return chat_text(
        tokenizer,
        sample["input"],
        sample.get("answer_prefix") or "",
        use_chat_template=bool(sample.get("use_chat_template", True)),
    )
