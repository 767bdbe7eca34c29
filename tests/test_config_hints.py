"""A config error names the closest valid key or value, and arrives without torch being imported (the
configuration's schema is cached: `eval.schema`, `centroidkv.schema`); the methods' parameter rules,
declared once on their fields (`centroidkv.params`), reject what the methods reject."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from centroidkv.schema import build_schema, check_method_spec, method_errors
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
sys.argv = ["scripts/run.py", *sys.argv[1:]]
try:
    runpy.run_path("scripts/run.py", run_name="__main__")
except SystemExit as stop:
    print("exit", stop.code, "torch" in sys.modules, file=sys.stderr)
"""


def test_a_bad_key_or_value_is_one_line_without_importing_torch():
    def probe(*argv: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        return done.stderr.strip().splitlines()

    probe(
        "benchmark.n_sample=1"
    )  # the first run may build the schema's cache (that one imports the registry)
    for argv, fragment in [
        (["benchmark.n_sample=1"], "did you mean benchmark.n_samples=1?"),
        (["budgets=[1.5]"], "budgets: budget must be a fraction in (0, 1], got 1.5"),
        (
            ["method.params.heads=wholee"],
            "heads must be one of none, whole, budget, got 'wholee'; did you mean whole?",
        ),
        (["methods=[centroidkvv]"], "unknown method 'centroidkvv'"),
        (["method=centroidkv", "method.params.r_min=0.9"], "r_min (0.9) must not exceed r_init (0.5)"),
        (["method=kvpress", "method.params.press=TOVAPres"], "did you mean TOVAPress?"),
    ]:
        error, status = probe(*argv)
        assert error.startswith("config error: ") and fragment in error, (argv, error)
        assert status == "exit 2 False", argv  # exit status 2, and torch never imported


# ------------------------------------------------------------------ the methods' declared rules
SCHEMA = build_schema()  # from the registry itself (this process has imported it)


def test_every_method_s_defaults_pass_its_rules():
    from centroidkv import get_method

    assert SCHEMA["methods"].keys() >= {"centroidkv", "snapkv", "kvpress", "kivi", "full"}
    for name, method in SCHEMA["methods"].items():
        defaults = {key: rule["default"] for key, rule in method["rules"].items()}
        assert method_errors(name, defaults, SCHEMA) == [], name
        assert method["params"] == get_method(name).params(), name  # Hydra's node: what a run records
    assert SCHEMA["methods"]["kvpress"]["shorthand"] == "press"


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("centroidkv", {"n_recent": -3}, "centroidkv: n_recent must be an integer >= 0, got -3"),
        ("centroidkv", {"n_sink": True}, "centroidkv: n_sink must be an integer >= 0, got True"),
        ("snapkv", {"heads_fraction": 1.5}, "snapkv: heads_fraction must be a number in [0.0, 1.0], got 1.5"),
        ("h2o", {"heads_boost": 1.0}, "h2o: heads_boost must be a number > 1, got 1.0"),
        ("h2o", {"heads_boost": float("inf")}, "h2o: heads_boost must be a number > 1, got inf"),
        ("centroidkv", {"chunk_size": 3}, "centroidkv: chunk_size must be even (A/B alternate), got 3"),
        ("centroidkv", {"r_init": 0}, "centroidkv: r_init must be a number in (0.0, 1.0], got 0"),
        (
            "centroidkv",
            {"schedule": "adaptiv"},
            "schedule must be one of linear, adaptive, got 'adaptiv'; did you mean adaptive?",
        ),
        ("snapkv", {"kernel_size": 4}, "snapkv: kernel_size must be odd (same-length pooling), got 4"),
        ("h2o", {"recent_ratio": 1.0}, "h2o: recent_ratio must be a number in [0.0, 1.0)"),
        ("pyramidkv", {"beta": 0.5}, "pyramidkv: beta must be a number in [1.0, inf], got 0.5"),
        ("kmeans", {"cosine": 1}, "kmeans: cosine must be True or False, got 1"),
        ("cam", {"merge_budget": 0}, "cam: merge_budget must be an integer >= 1, got 0"),
        ("kivi", {"kv_precision": "int8"}, "kv_precision must be one of int2, int4 (KIVI-2, KIVI-4"),
        ("duo_attention", {"heads": "budget"}, "duo_attention: heads must be whole"),
        (
            "full",
            {"kv_group": 0},
            "full: kv_group must be a power of two in [1, 256] (it divides the head size), got 0",
        ),
        ("kvpress", {"press_params": 3}, "kvpress: press_params must be a mapping, got 3"),
        ("kvpress", {"heads": "whole"}, "kvpress: heads must be none (presses compress inside kvpress's"),
        ("centroidkv", {"n_recnt": 3}, "centroidkv: unknown parameter(s) n_recnt; known: "),
        # bounds by another parameter: given, or at its default; a subclass inherits them
        ("centroidkv", {"r_min": 0.9, "r_init": 0.1}, "centroidkv: r_min (0.9) must not exceed r_init (0.1)"),
        ("centroidkv", {"r_min": 0.7}, "centroidkv: r_min (0.7) must not exceed r_init (0.5)"),
        ("snapkv", {"window_size": 64}, "snapkv: window_size (64) must not exceed n_recent (32) (the"),
        ("pyramidkv", {"n_recent": 16}, "pyramidkv: window_size (32) must not exceed n_recent (16)"),
        # kvpress's press names, read from kvpress when the schema is built
        ("kvpress", {"press": "SnapKVPres"}, "got 'SnapKVPres'; did you mean SnapKVPress?"),
    ],
)
def test_a_declared_rule_rejects_what_the_method_rejects(name, params, message):
    """The same line from the schema (no torch) and from building the method (`Method.validate`)."""
    from centroidkv import get_method

    lines = method_errors(name, params, SCHEMA)
    assert len(lines) == 1 and message in lines[0], lines
    with pytest.raises(ValueError) as error:
        get_method(name, **params)
    assert str(error.value) == lines[0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("centroidkv", None),
        ("centroidkv(n_recent=32, heads=none, r_init=1)", None),
        ("kvpress:TOVAPress", None),
        ("centroidkvv", "unknown method 'centroidkvv'; choose one of centroidkv, "),
        ("centroidkvv(n_recent=3)", "; did you mean centroidkv?"),
        ("centroidkv(n_recnt=3)", "centroidkv: unknown parameter(s) n_recnt; known: "),
        ("centroidkv(n_recnt=3)", "; did you mean n_recent?"),
        (
            "centroidkv(heads=wholee)",
            "centroidkv: heads must be one of none, whole, budget, got 'wholee'; did you mean whole?",
        ),
        ("centroidkv(n_recent=-1)", "centroidkv: n_recent must be an integer >= 0, got -1"),
        ("snapkv:x", "method 'snapkv:x': snapkv takes no name:value form"),
        ("centroidkv(x)", "method 'centroidkv(x)': 'x' is not key=value"),
        ("centroidkv[", "write name, name:value or name(key=value, ...)"),
    ],
)
def test_a_method_spec_is_checked_without_building_it(spec, message):
    from centroidkv.methods import parse_method

    if message is None:
        check_method_spec(spec, SCHEMA)
        parse_method(spec)  # the library's own parser agrees
        return
    with pytest.raises(ValueError) as error:
        check_method_spec(spec, SCHEMA)
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError):
        parse_method(spec)
