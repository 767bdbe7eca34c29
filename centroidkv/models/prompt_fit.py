"""Whether a prompt fits in a model's positions, and a context cut in the middle until it does (as
LongBench truncates): what `scripts/generate.py` checks before any model loads."""

from __future__ import annotations


def prompt_length(tokenizer, context: str, question: str, protocol: str) -> int:
    """The prompt's tokens, the chat template included (what the model's positions must hold besides
    the new tokens), whichever way the protocol splits them."""
    from centroidkv.models.chat import chat_prompt_ids

    message = f"{context}\n\n{question}" if question else context
    head, tail = chat_prompt_ids(tokenizer, message, question, context_only=protocol == "context_only")
    return len(head) + len(tail)


def check_fits(n_prompt: int, max_new_tokens: int, positions: int | None, model_name: str) -> None:
    """ValueError (one line) unless the prompt and the new tokens fit in the model's positions."""
    if positions is not None and n_prompt + max_new_tokens > positions:
        raise ValueError(
            f"the prompt ({n_prompt} tokens) and --max-new-tokens ({max_new_tokens}) need "
            f"{n_prompt + max_new_tokens} positions, more than {model_name}'s {positions}: shorten the "
            "context, lower --max-new-tokens, or pass --truncate to cut the middle of the context"
        )


def truncate_context(
    tokenizer, context: str, question: str, protocol: str, max_new_tokens: int, positions: int
) -> str:
    """`context` with its middle cut (its first and last tokens kept, as LongBench truncates) so that
    the prompt and `max_new_tokens` fit in `positions`; unchanged when they already do."""
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    keep = len(ids)
    for _ in range(8):  # decoding and encoding again may change a few tokens at the cut
        excess = prompt_length(tokenizer, context, question, protocol) + max_new_tokens - positions
        if excess <= 0:
            return context
        keep -= excess
        if keep < 2:
            raise ValueError(
                f"the question, the chat template and --max-new-tokens ({max_new_tokens}) alone need "
                f"more than the model's {positions} positions"
            )
        half = keep // 2
        context = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[len(ids) - (keep - half) :], skip_special_tokens=True
        )
    raise ValueError(f"the context could not be cut to fit the model's {positions} positions")
