"""A sample's identity and its prompt as token ids (chat template, answer prefix, context/question split)."""

from __future__ import annotations

from centroidkv.decoding import chat_prompt_ids
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
    return chat_prompt_ids(
        tokenizer,
        sample["input"],
        question=sample.get("question"),
        context_only=context_only,
        answer_prefix=sample.get("answer_prefix") or "",
        use_chat_template=bool(sample.get("use_chat_template", True)),
    )
