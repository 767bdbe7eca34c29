"""The options of a per-prompt plan (`centroidkv.plan`) that configurations and command lines check
before torch is imported: the protocols and the default decode batch."""

CONTEXT_ONLY, FULL_PROMPT = "context_only", "full_prompt"
PROTOCOLS = (FULL_PROMPT, CONTEXT_ONLY)
DEFAULT_DECODE_BATCH = 32  # forks decoded together at most (every fork of a batch is alive at once)
