"""A config error names the closest valid key, and arrives without torch being imported (the
configuration's schema is cached: `eval.schema`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eval.schema import suggestion

ROOT = Path(__file__).resolve().parent.parent

KEYS = {
    "budgets": None,
    "methods": None,
    "model": {},
    "method.budget": 0.5,
    "method.params.n_recent": 64,
    "benchmark.n_samples": 25,
    "benchmark.name": "ruler",
    "benchmark.lengths": [4096],
    "logger.mode": "auto",
}


@pytest.mark.parametrize(
    "key, value, hint",
    [
        ("benchmark.n_sample", "1", "did you mean benchmark.n_samples=1?"),
        ("budget", "0.25", "did you mean budgets=[0.25] or method.budget=0.25?"),
        ("benchmark.lenghts", "[1024]", "did you mean benchmark.lengths=[1024]?"),
        ("method.params.n_recnt", "3", "did you mean method.params.n_recent=3?"),
        ("modle", "tiny-llama", "did you mean model=tiny-llama or logger.mode=tiny-llama?"),
        ("zzz", "1", ""),
    ],
)
def test_the_closest_keys_are_suggested(key, value, hint):
    assert suggestion(key, value, KEYS) == hint


PROBE = """
import runpy, sys
sys.argv = ["scripts/run.py", "benchmark.n_sample=1"]
try:
    runpy.run_path("scripts/run.py", run_name="__main__")
except SystemExit as stop:
    print("exit", stop.code, "torch" in sys.modules, file=sys.stderr)
"""


def test_a_bad_key_is_one_line_naming_the_key_without_importing_torch():
    def probe() -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        return done.stderr.strip().splitlines()

    probe()  # the first run may build the schema's cache (that one imports the registry)
    error, status = probe()
    assert error.startswith("config error: ") and "did you mean benchmark.n_samples=1?" in error
    assert status == "exit 2 False"  # exit status 2, and torch never imported
