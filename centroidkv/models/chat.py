"""A prompt as the model reads it: the chat template around a user message, then its token ids, split
before the question under the context-only protocol (the question is fed after compression)."""

from __future__ import annotations


def chat_text(tokenizer, user_message: str, answer_prefix: str = "", use_chat_template: bool = True) -> str:
    """The prompt as text: the chat template around `user_message` as the user's turn with the
    assistant's generation prompt (when the tokenizer has one and `use_chat_template`), then
    `answer_prefix`."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = user_message
    return text + (answer_prefix or "")


def split_ids(tokenizer, text: str, question: str | None) -> tuple[list[int], list[int]]:
    """Token ids of `text` as (the part before the last occurrence of `question`, the rest): the
    context-only split. The whole text is the first part when `question` is None, empty, absent or
    at the very start (the full-prompt protocol)."""
    split = len(text)
    if question:
        found = text.rfind(question)
        if found > 0:
            split = found
    head = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    tail = tokenizer(text[split:], add_special_tokens=False)["input_ids"] if split < len(text) else []
    return head, tail


def chat_prompt_ids(
    tokenizer,
    user_message: str,
    question: str | None = None,
    context_only: bool = False,
    answer_prefix: str = "",
    use_chat_template: bool = True,
) -> tuple[list[int], list[int]]:
    """Token ids of a prompt as (the part to prefill, the part fed after compression).

    The chat template (when the tokenizer has one and `use_chat_template`) wraps `user_message` as
    the user's turn and adds the assistant's generation prompt; `answer_prefix` follows. With
    `context_only`, the text from the last occurrence of `question` on is the second part (the
    context-only protocol); otherwise the second part is empty (the full-prompt protocol).
    """
    text = chat_text(tokenizer, user_message, answer_prefix, use_chat_template)
    return split_ids(tokenizer, text, question if context_only else None)
