"""The plugin's commands run in .venv-serve: started from a Python without vLLM (the harness's venv),
each says so in one line and exits 2, instead of a traceback from deep inside the engine's start."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM: the plugin's commands run"
)


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "centroidkv_vllm", "generate"],
        ["scripts/serve_bench.py", "--quick"],
        ["scripts/bench_plugin_attention.py"],
    ],
)
def test_a_plugin_command_without_vllm_fails_in_one_line(command):
    done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "make serve-venv" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
