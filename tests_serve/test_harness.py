"""The plugin against the harness's own CentroidKV on the same token ids, in float32.

The plugin (`python -m centroidkv_vllm generate`, this venv) and `scripts/serve_vs_harness.py` (the
harness, in the main venv `.venv`, which `make test` builds first) run the same prompts with the same
settings: every head compressed, post-RoPE similarity, budgets in entries, the same g and windows.
Float32 on both sides, so that a bf16 near-tie cannot flip a greedy token. Minutes on a CPU; skipped
when the converted model folder or the main venv is absent.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_engine import ENV, needs_model, run_generate

from centroidkv_vllm.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
HARNESS_PYTHON = ROOT / ".venv" / "bin" / "python"
BUDGET, INTERVAL, NEW = 0.5, 32, 48

needs_harness = pytest.mark.skipif(not HARNESS_PYTHON.is_file(), reason="no main venv (.venv)")


def held_entries(prompt_tokens: int, new_tokens: int) -> int:
    """Entries per layer at the end by the plugin's own rule (`Plan`): the cache ends at n + T - 1
    entries (the last token is sampled, never written), after the compression due there. The harness
    compresses at the end of the step that reaches B + g, the plugin at the start of the next one:
    every step attends over the same entries, and the plugin's last compression is the one that
    would come with a next step."""
    plan = Plan.at(prompt_tokens, BUDGET, NEW, INTERVAL)
    length = prompt_tokens + new_tokens - 1
    return length - plan.start(length)


@needs_model
@needs_harness
def test_plugin_tokens_and_entries_equal_the_harness(tmp_path):
    settings = ("--budget", str(BUDGET), "--compress-interval", str(INTERVAL), "--max-tokens", str(NEW))
    result, log = run_generate(*settings, "--dtype", "float32", "--long-chars", "3000")
    assert result is not None, log[-3000:]
    assert result["prompt_tokens"][-1] > 700  # the long prompt (723 tokens) is compressed, then twice more
    plugin_out = tmp_path / "plugin.out"
    plugin_out.write_text("CENTROIDKV_RESULT " + json.dumps(result) + "\n")
    proc = subprocess.run(
        [str(HARNESS_PYTHON), str(ROOT / "scripts" / "serve_vs_harness.py"), str(plugin_out)]
        + ["--dtype", "float32", "--json"],  # the plugin's settings come with its result
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SERVE_VS_HARNESS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    for row in json.loads(lines[0].split(" ", 1)[1]):
        n, new = row["prompt_tokens"], row["new_tokens"]
        assert row["centroidkv"]["agree"] == new, row
        assert row["centroidkv"]["entries"] == held_entries(n, new), row
