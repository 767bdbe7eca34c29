"""Blocks freed and reused: with a KV pool that holds two full-cache requests, the plugin at R = 1/4
runs more requests at once, and its greedy tokens equal its own without the pool limit.

Float32 (model and cache): in bf16 vLLM's own greedy tokens depend on which requests share a batch
(stock vLLM, 6 prompts of 1000 tokens: one of them changes at its 27th token between a pool of 21
blocks and one of 213), which would hide what this test is about. Minutes on a CPU; run in
.venv-serve (`make serve-test`), skipped when the converted model folder is absent.
"""

from __future__ import annotations

import math

import pytest
from test_engine import needs_model, run_generate

REQUESTS, PROMPT, NEW = 6, 1000, 64
BLOCK = 128


def workload(kv_mib: int, *extra: str) -> dict:
    result, log = run_generate(
        "--budget",
        "0.25",
        "--compress-interval",
        "32",
        "--dtype",
        "float32",
        "--requests",
        str(REQUESTS),
        "--prompt-tokens",
        str(PROMPT),
        "--max-tokens",
        str(NEW),
        "--kv-mib",
        str(kv_mib),
        *extra,
        command="workload",
    )
    assert result is not None, log[-3000:]
    return result


@pytest.fixture(scope="module")
def unlimited() -> dict:
    return workload(1200)


@pytest.mark.slow  # 4 min on an AVX2-only machine; make test keeps the rule of what is freed (test_heads)
@needs_model
def test_freed_blocks_let_more_requests_run_with_the_same_tokens(unlimited):
    small = workload(120)  # 21 blocks of 128 slots (the null block included) in float32
    full_cache_fits = (small["num_blocks"] - 1) // math.ceil((PROMPT + NEW) / BLOCK)
    assert full_cache_fits == 2
    assert max(small["running"]) > full_cache_fits + 1, small["running"]
    assert small["freed_early"] > 0
    assert min(small["free_blocks"]) >= 0
    assert small["tokens"] == unlimited["tokens"]
    assert all(len(t) == NEW for t in small["tokens"])


@pytest.mark.slow  # the control: `make serve-test` runs it, `make test` keeps under 10 minutes without it
@needs_model
def test_without_its_scheduler_the_plugin_frees_nothing(unlimited):
    """The control: the same backend and layout with vLLM's own scheduler keeps every block, so no
    more than the full cache's two requests run at once (what the plugin did before it freed). It runs
    the same six prompts: the prompts a workload builds depend on how many it asks for."""
    kept = workload(120, "--keep-blocks")
    assert max(kept["running"]) == 2 and kept["freed_early"] == 0
    assert kept["tokens"][:2] == unlimited["tokens"][:2]


@pytest.mark.slow
@needs_model
def test_a_preempted_request_is_prefilled_again_and_finishes():
    """Preemption by recompute is supported, not refused: at R = 1/2 with 256 new tokens the same pool
    runs out while requests grow, vLLM preempts one, and the plugin plans it again from its second
    prefill (`centroidkv_vllm.plan`) on both sides; every request still gets all of its tokens."""
    result, log = run_generate(
        *("--budget", "0.5", "--compress-interval", "32", "--dtype", "float32"),
        *("--requests", str(REQUESTS), "--prompt-tokens", str(PROMPT), "--max-tokens", "256"),
        *("--kv-mib", "120"),
        command="workload",
    )
    assert result is not None, log[-3000:]
    assert result["preemptions"] >= 1, result["running"]
    assert [len(tokens) for tokens in result["tokens"]] == [256] * REQUESTS
    assert result["freed_early"] > 0
