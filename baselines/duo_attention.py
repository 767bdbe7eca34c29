"""DuoAttention: retrieval heads keep the full cache, streaming heads keep sinks and a recent window.

Paper: Xiao, Tang, Zuo, Guo, Yang, Tang, Fu, Han, "DuoAttention: Efficient Long-Context LLM Inference
with Retrieval and Streaming Heads", ICLR 2025 (arXiv 2410.10819). A small fraction of attention
heads ("retrieval heads") need every token; the others ("streaming heads") do as well with the
attention sinks and the most recent tokens. Retrieval heads keep their full KV cache, streaming heads
a StreamingLLM cache.

Here: StreamingLLM (`baselines.streaming_llm`) with the head policy `heads=whole`, so the retrieval
heads are the KV heads this harness lists by its offline calibration (`heads_file="streaming"`: the
relative error of each head's attention output with only sinks and a recent window, on dev needle
prompts; `python -m eval.calibrate --score streaming`). How it differs:
- the paper learns a gate per head by optimisation on synthetic passkey data and thresholds it;
  we rank heads by the output error of a streaming cache and list the worst `heads_fraction`;
- the paper's heads are query heads (merged per KV head under GQA by its deployment code); ours are
  KV heads, so a listed head keeps the cache all its query heads read;
- the streaming heads' window here is the byte budget's: in bytes, the retrieval heads are paid for
  by the streaming heads (the paper fixes the streaming window and lets the memory follow);
- kvpress's `DuoAttentionPress` downloads the paper's head patterns from the Hub and masks the
  streaming heads' evicted entries without freeing them; here the tensors really shrink.

Parameters: those of StreamingLLM (n_sink 4, n_recent 64, g 64) and the head policy, whose defaults
here are heads="whole", heads_file="streaming", heads_fraction 0.04 (DuoAttention keeps a quarter to
a half of the heads whole on 7-8B models; with 90 KV heads on the embedded model and budgets of 1/4
or less, 4 % is what the budget affords: raise it with heads_fraction).
"""

from __future__ import annotations

from dataclasses import dataclass

from baselines.streaming_llm import StreamingLLM
from centroidkv.methods import param, register


@register
@dataclass
class DuoAttention(StreamingLLM):
    name = "duo_attention"
    label = "DuoAttention"

    # its retrieval heads keep the full cache: the one head policy it takes (`centroidkv.head_policy`)
    wrapper_params = {
        "heads": param(
            "whole",
            choices=("whole",),
            reason="the retrieval heads keep the full cache; other policies: streaming_llm",
        ),
        "heads_file": "streaming",
    }
