"""A sample's identity and its prompt as token ids (chat template, answer prefix, context/question split)."""

from __future__ import annotations

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
    use_chat = sample.get("use_chat_template", True) and getattr(tokenizer, "chat_template", None)
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample["input"]}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = sample["input"]
    text += sample.get("answer_prefix") or ""
    split = len(text)
    if context_only and sample.get("question"):
        found = text.rfind(sample["question"])
        if found > 0:
            split = found
    head = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    tail = tokenizer(text[split:], add_special_tokens=False)["input_ids"] if split < len(text) else []
    return head, tail
