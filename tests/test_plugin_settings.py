"""The vLLM plugin's settings (`centroidkv_vllm.config.CentroidConfig.from_dict`) are checked by type
and range, one line each (a bool is a bool, never the string "false"; a count is an int within
range), and `python -m centroidkv_vllm` refuses a bad one in one line before vLLM is imported or the
engine starts (issue 53, defect 8). No vLLM needed: this environment has none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from centroidkv_vllm.config import MAX_COUNT, CentroidConfig, SettingsError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"own_attention": "false"}, "centroidkv: own_attention must be True or False, got 'false'"),
        ({"compiled_attention": 0}, "centroidkv: compiled_attention must be True or False, got 0"),
        (
            {"max_new_tokens": 1.5},
            f"centroidkv: max_new_tokens must be an integer in [0, {MAX_COUNT}], got 1.5",
        ),
        ({"max_new_tokens": 10**30}, "centroidkv: max_new_tokens must be an integer in [0, "),
        ({"max_new_tokens": "100"}, "centroidkv: max_new_tokens must be an integer in [0, "),
        ({"n_recent": True}, "centroidkv: n_recent must be an integer in [0, "),
        ({"compress_interval": 0}, "centroidkv: compress_interval must be an integer in [1, "),
        ({"chunk_size": 3}, "centroidkv: chunk_size must be even (A/B alternate), got 3"),
        ({"schedule": "adaptiv"}, "centroidkv: schedule must be one of linear, adaptive, got 'adaptiv'"),
        ({"r_min": 0.9}, "centroidkv: r_min (0.9) must not exceed r_init (0.5)"),
        ({"budget": 0}, "centroidkv: budget must be a fraction in (0, 1], got 0"),
        ({"budget": "0.5"}, "centroidkv: budget must be a number, got '0.5'"),
        ({"bugdet": 0.5}, "centroidkv: unknown parameter(s) bugdet; known: budget, "),
        ([("budget", 0.5)], "centroidkv: the settings must be a mapping, got [('budget', 0.5)]"),
    ],
)
def test_a_bad_setting_is_one_line(settings, line):
    with pytest.raises(SettingsError) as refused:
        CentroidConfig.from_dict(settings)
    assert str(refused.value).startswith(line) and len(str(refused.value).splitlines()) == 1


def test_good_settings_are_kept_as_given():
    config = CentroidConfig.from_dict({"budget": 1, "max_new_tokens": 0, "own_attention": True, "r_min": 0.5})
    assert (config.budget, config.max_new_tokens, config.own_attention, config.r_min) == (1, 0, True, 0.5)
    assert CentroidConfig.from_dict({}) == CentroidConfig()


@pytest.mark.parametrize("argv", [["generate", "--budget", "0"], ["workload", "--n-sink", "-1"]])
def test_the_command_line_refuses_a_bad_setting_in_one_line_before_the_engine(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    probe = (
        "import runpy, sys; sys.argv = ['centroidkv_vllm', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('centroidkv_vllm', run_name='__main__')\n"
        "finally:\n    print('vllm imported:', 'vllm' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("python -m centroidkv_vllm: centroidkv: "), done.stderr
    assert done.stdout.strip() == "vllm imported: False"
