"""The plugin against the harness's own CentroidKV on the same token ids, in float32.

The plugin (`python -m centroidkv_vllm generate`, this venv) and `scripts/serve_vs_harness.py` (the
harness, in the main venv `.venv`, which `make test` builds first) run the same prompts with the same
settings: post-RoPE similarity, the same g and windows, and either every head compressed with budgets
in entries (heads=none) or the calibrated heads kept whole with budgets in bytes over both parts
(heads=whole, on essay windows and the needle prompts of `make demo`). Float32 on both sides, so that
a bf16 near-tie cannot flip a greedy token. Minutes on a CPU; skipped when the converted model folder
or the main venv is absent.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_engine import ENV, needs_model, run_generate

from centroidkv_vllm.__main__ import DEFAULT_MODEL
from centroidkv_vllm.config import CentroidConfig
from centroidkv_vllm.heads import HeadLayout, listed_heads
from centroidkv_vllm.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
HARNESS_PYTHON = ROOT / ".venv" / "bin" / "python"
BUDGET, INTERVAL, NEW = 0.5, 32, 48

needs_harness = pytest.mark.skipif(not HARNESS_PYTHON.is_file(), reason="no main venv (.venv)")


def held_entries(prompt_tokens: int, new_tokens: int, plan: Plan | None = None) -> int:
    """Entries per layer at the end by the plugin's own rule (`Plan`): the cache ends at n + T - 1
    entries (the last token is sampled, never written), after the compression due there. The harness
    compresses at the end of the step that reaches B + g, the plugin at the start of the next one:
    every step attends over the same entries, and the plugin's last compression is the one that
    would come with a next step."""
    plan = plan or Plan.at(prompt_tokens, BUDGET, NEW, INTERVAL)
    length = prompt_tokens + new_tokens - 1
    return length - plan.start(length)


def compare(plugin_result: dict, tmp_path: Path, *extra: str) -> list[dict]:
    """`scripts/serve_vs_harness.py` on the plugin's result: one row per prompt."""
    plugin_out = tmp_path / "plugin.out"
    plugin_out.write_text("CENTROIDKV_RESULT " + json.dumps(plugin_result) + "\n")
    proc = subprocess.run(
        [str(HARNESS_PYTHON), str(ROOT / "scripts" / "serve_vs_harness.py"), str(plugin_out)]
        + ["--dtype", "float32", "--json", *extra],  # the plugin's settings come with its result
        capture_output=True,
        text=True,
        env=ENV,
        timeout=1200,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SERVE_VS_HARNESS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[0].split(" ", 1)[1])


WHOLE_BUDGET, WHOLE_INTERVAL, WHOLE_NEW = 0.25, 16, 32


@pytest.mark.slow
@needs_model
@needs_harness
def test_heads_whole_tokens_entries_and_needles_equal_the_harness(tmp_path):
    """heads=whole at R = 1/4 in bytes: 3 essay windows of 1000 tokens and the two needle prompts of
    `make demo` (4k tokens), 32 new tokens with g = 16 (so B is solved again at later compressions):
    every greedy token, the compressed heads' entries at the end and the needle answers are the
    harness's."""
    prompts = tmp_path / "prompts.json"
    written = subprocess.run(
        [str(HARNESS_PYTHON), str(ROOT / "scripts" / "serve_vs_harness.py"), "--write-prompts", str(prompts)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert written.returncode == 0, written.stdout[-2000:] + written.stderr[-2000:]
    settings = ("--budget", str(WHOLE_BUDGET), "--compress-interval", str(WHOLE_INTERVAL))
    result, log = run_generate(
        *settings, "--max-tokens", str(WHOLE_NEW), "--heads", "whole", "--dtype", "float32",
        "--prompt-ids", str(prompts), "--kv-mib", "1024",
    )  # fmt: skip
    assert result is not None, log[-3000:]
    config = CentroidConfig.from_dict(result["settings"])
    listed = listed_heads(config, str(DEFAULT_MODEL), 30, 3)
    assert listed == {7: [2], 17: [1], 18: [2], 23: [0]}  # the packaged calibration's worst 4 of 90
    layout = HeadLayout(tuple(tuple(listed.get(i, ())) for i in range(30)), 3, 64, 4, 3)
    rows = compare(result, tmp_path, "--prompts", str(prompts))
    assert len(rows) == 5 and [row["prompt_tokens"] > 900 for row in rows] == [True] * 5
    for row in rows:
        n, new = row["prompt_tokens"], row["new_tokens"]
        assert new == WHOLE_NEW and row["centroidkv"]["agree"] == new, row
        plan = Plan.at(n, WHOLE_BUDGET, WHOLE_NEW, WHOLE_INTERVAL, layout.budget_at(config, n))
        assert row["centroidkv"]["entries"] == held_entries(n, new, plan), row
    needles = [row for row in rows if "plugin_answer" in row]
    assert [row["name"] for row in needles] == ["niah_single_1", "niah_single_2"]
    for row in needles:
        assert row["plugin_answer"] == row["centroidkv"]["answer"], row


@needs_model
@needs_harness
def test_plugin_tokens_and_entries_equal_the_harness(tmp_path):
    settings = ("--budget", str(BUDGET), "--compress-interval", str(INTERVAL), "--max-tokens", str(NEW))
    result, log = run_generate(*settings, "--dtype", "float32", "--long-chars", "3000")
    assert result is not None, log[-3000:]
    assert result["prompt_tokens"][-1] > 700  # the long prompt (723 tokens) is compressed, then twice more
    for row in compare(result, tmp_path):
        n, new = row["prompt_tokens"], row["new_tokens"]
        assert row["centroidkv"]["agree"] == new, row
        assert row["centroidkv"]["entries"] == held_entries(n, new), row
