"""The plugin inside vLLM's engine on the embedded model (real weights; minutes on a CPU).

Run in .venv-serve (`make serve-test`); skipped when the converted model folder is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from centroidkv_vllm.__main__ import DEFAULT_MODEL
from centroidkv_vllm.config import refusal

needs_model = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="no converted model")
# The engine core and its worker in the command's own process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0):
# half the start-up of vLLM's default three processes; test_readme_example runs those.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_generate(*args: str, command: str = "generate") -> tuple[dict | None, str]:
    """`python -m centroidkv_vllm COMMAND ARGS` in its own process: (result, log)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "centroidkv_vllm",
            command,
            *args,
            *(["--json"] if command == "generate" else []),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith("CENTROIDKV_RESULT "):
            return json.loads(line.split(" ", 1)[1]), log
    return None, log


# float32: this CPU has no bf16 instructions, so a bf16 engine spends about 2.4x the CPU time on the
# same generation (the bf16 path keeps its own tests: the profile below, tests_serve/test_compiled_checks.py).
FLOAT32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def stock() -> dict:
    result, log = run_generate("--stock", *FLOAT32, "--long-chars", "3000")
    assert result is not None, log[-3000:]
    return result


@pytest.fixture(scope="module")
def plugin_at_one() -> tuple[dict, str]:
    """The plugin at R = 1 through vLLM's attention kernel, and its log."""
    result, log = run_generate("--budget", "1.0", *FLOAT32, "--long-chars", "3000")
    assert result is not None, log[-3000:]
    return result, log


@needs_model
def test_budget_one_gives_stock_tokens(stock, plugin_at_one):
    """At R = 1 nothing is merged: the plugin's backend must give vLLM's own greedy tokens."""
    result, log = plugin_at_one
    assert "centroidkv: plugin on" in log
    assert result["tokens"] == stock["tokens"]


# The plugin loaded (its backend replaces CPU_ATTN) but the engine not configured for it.
UNCONFIGURED = """
import json, sys
from vllm import SamplingParams
from centroidkv_vllm import __main__ as cli, workload
args = cli.parse_args(sys.argv[1:])
engine = cli.llm_args(args)
del engine["additional_config"], engine["scheduler_cls"]
llm = workload.make_llm(engine, stock=False)
layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()
prompts = [*cli.SHORT_PROMPTS, cli.long_prompt(args.long_chars)]
params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
outputs = llm.generate(prompts, params, use_tqdm=False)
print("UNCONFIGURED " + json.dumps({
    "impls": sorted({type(layer.impl).__name__ for layer in layers if hasattr(layer, "impl")}),
    "tokens": [list(o.outputs[0].token_ids) for o in outputs],
}))
"""


@needs_model
def test_the_unconfigured_backend_gives_stock_tokens(stock):
    """Without `additional_config["centroidkv"]` the plugin's backend (which writes the step's entries in
    its own forward) is stock vLLM's attention: the same greedy tokens."""
    argv = ["generate", *FLOAT32, "--long-chars", "3000"]
    proc = subprocess.run(
        [sys.executable, "-c", UNCONFIGURED, *argv], capture_output=True, text=True, env=ENV, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UNCONFIGURED ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(lines[0].split(" ", 1)[1])
    assert result["impls"] == ["CentroidImpl"]
    assert result["tokens"] == stock["tokens"]


@needs_model
def test_budget_half_compresses_after_prefill(stock):
    """At R = 1/2 the long prompt (n tokens) is merged to B = (n + 32) / 2 entries in every layer once
    the prompt is in; the short prompts fit their budget and keep vLLM's tokens."""
    result, log = run_generate("--budget", "0.5", *FLOAT32, "--long-chars", "3000")
    assert result is not None, log[-3000:]
    n = result["prompt_tokens"][-1]
    assert f"compressed from {n} to {(n + 32) // 2} entries in 30 layers" in log
    assert result["tokens"][:3] == stock["tokens"][:3]
    assert len(result["tokens"][-1]) == 32


@needs_model
def test_prefix_caching_is_refused_by_the_engine():
    """The engine does not start, and its error names the unsupported feature in one line."""
    result, log = run_generate("--budget", "0.5", "--enable-prefix-caching")
    assert result is None
    assert "centroidkv: prefix caching is not supported" in log


@pytest.mark.parametrize(
    "change, line",
    [
        ({"speculative_config": object()}, "centroidkv: speculative decoding is not supported"),
        ({"cache_dtype": "fp8"}, "centroidkv: kv_cache_dtype=fp8 is not supported"),
        ({"isa": "amx"}, "centroidkv: the CPU attention ISA 'amx' is not supported"),
        ({"window": 512}, "centroidkv: sliding-window attention is not supported"),
    ],
)
def test_each_unsupported_feature_has_its_line(change, line):
    cache = SimpleNamespace(enable_prefix_caching=False, cache_dtype=change.get("cache_dtype", "auto"))
    config = SimpleNamespace(cache_config=cache, speculative_config=change.get("speculative_config"))
    found = refusal(config, change.get("isa", "vec"), change.get("window", -1))
    assert found is not None and found.startswith(line)


@needs_model
def test_chunked_prefill_compresses_once_the_prompt_is_in_then_every_g():
    """Prefill in chunks of 256 tokens: the first compression waits for the whole prompt (n), then the
    request is compressed back to B each time it has grown to B + g, as in the harness."""
    result, log = run_generate(
        "--budget",
        "0.5",
        "--long-chars",
        "3000",
        "--max-tokens",
        "96",
        "--compress-interval",
        "32",
        "--max-num-batched-tokens",
        "256",
        *FLOAT32,
    )
    assert result is not None, log[-3000:]
    n = result["prompt_tokens"][-1]
    budget = (n + 96) // 2
    assert f"logical length {n} compressed from {n} to {budget} entries" in log
    assert log.count(f"compressed from {budget + 32} to {budget} entries") == 2
    assert not any(f"logical length {m} compressed" in log for m in range(budget, n))  # none mid-prefill


@needs_model
def test_own_attention_gives_the_kernel_tokens_in_float32(plugin_at_one):
    """Every decoding row through the plugin's batched attention (R = 1, log-degrees 0) gives vLLM's
    kernel's greedy tokens in float32 (in bf16 the two round differently and near-ties flip)."""
    own, log = run_generate("--budget", "1.0", "--own-attention", *FLOAT32, "--long-chars", "3000")
    assert own is not None, log[-3000:]
    kernel, _ = plugin_at_one
    assert own["tokens"] == kernel["tokens"]


def test_profile_refuses_a_window_its_requests_would_not_last(capsys):
    """`python -m centroidkv_vllm profile`: the requests must outlast the warm-up and profiled steps;
    refused with one line before any model loads."""
    from centroidkv_vllm.__main__ import parse_args

    assert parse_args(["profile"]).max_tokens == 512
    for bad in (["--max-tokens", "130"], ["--steps", "0"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["profile", *bad])
        assert "--max-tokens > --warm-steps + --steps" in capsys.readouterr().err


@pytest.mark.slow  # minutes of engine time; the C++ loop keeps its fast check (test_compiled_checks.py)
@needs_model
def test_profile_finds_the_plugins_attention_in_its_decode_steps():
    """A small profile of the own-attention setting: its decode steps run the plugin's C++ loop."""
    args = ("--requests", "2", "--prompt-tokens", "256", "--warm-steps", "2", "--steps", "3")
    result, log = run_generate("--own-attention", "--max-tokens", "8", *args, command="profile")
    assert result is not None, log[-3000:]
    assert result["running"] == 2 and result["ms_per_step"] > 0
    names = [name for name, *_ in result["top"]]
    assert any("degree_decode" in name for name in names), names
