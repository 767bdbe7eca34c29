"""The options of a per-prompt plan (`centroidkv.plan.plan`) that configurations and command lines check
before torch is imported: the protocols and the default decode batch."""

CONTEXT_ONLY, FULL_PROMPT = "context_only", "full_prompt"
PROTOCOLS = (FULL_PROMPT, CONTEXT_ONLY)
DEFAULT_DECODE_BATCH = 32  # forks decoded together at most (every fork of a batch is alive at once)


def check_decode_batch(decode_batch: object) -> int:
    """The decode batch as an int; one ValueError line unless it is an integer >= 1."""
    if isinstance(decode_batch, bool) or not isinstance(decode_batch, int) or decode_batch < 1:
        raise ValueError(f"decode_batch: must be an integer >= 1, got {decode_batch!r}")
    return decode_batch
