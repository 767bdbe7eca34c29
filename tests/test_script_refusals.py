"""The diagnostic and benchmark scripts refuse bad input in one line, exit status 2, before a model
loads (the run, generate and bench_* entry points have their own tests); and prefill_sharing, whose
numbers docs/speed.md reports, runs end to end."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

CASES = [  # script, argv, a fragment of the line
    ("check_hybrid", ["--model", "gpt-9"], "unknown model 'gpt-9'"),
    ("check_hybrid", ["--budget", "2"], "budget must be a fraction"),
    ("diagnose_needles", ["--budgets", "0.5,7"], "budget must be a fraction"),
    ("diagnose_needles", ["--compared", "chunk_size"], "key=value"),
    ("diagnose_needles", ["--compared", "nosuch=3"], "unknown parameter(s) nosuch"),
    ("serve_vs_harness", ["/no/such/result"], "no such file"),
    ("serve_vs_harness", [str(SCRIPTS / "run.py")], "no CENTROIDKV_RESULT line"),
    ("bench_centroidkv_configs", ["--budgets", "0.25,3"], "budget must be a fraction"),
    ("bench_kmeans", ["--threads", "0"], "--threads"),
    ("ruler_full_baseline", ["--tasks", "niah_single_9"], "unknown RULER task"),
    ("ruler_full_baseline", ["--length", "100"], "length must be"),
    ("sample_walk", ["--methods", "full,nosuch"], "unknown method(s) nosuch"),
    ("sample_walk", ["--budget", "4"], "budget must be a fraction"),
    ("prefill_sharing", ["--methods", "full,nosuch"], "unknown method(s) nosuch"),
    ("prefill_sharing", ["--budget", "0"], "budget must be a fraction"),
    ("prefill_sharing", ["--max-new-tokens", "1"], "--max-new-tokens"),
]


def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the input was checked")


@pytest.mark.parametrize("script,argv,fragment", CASES, ids=lambda value: str(value)[:24])
def test_bad_input_is_one_line_and_status_2_before_a_model_loads(script, argv, fragment, monkeypatch, capsys):
    import centroidkv
    import centroidkv.models.loading

    module = importlib.import_module(script)
    for owner in (module, centroidkv, centroidkv.models.loading):
        if hasattr(owner, "load_model"):
            monkeypatch.setattr(owner, "load_model", no_model)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert fragment in error and "\n" not in error, error


@pytest.mark.usefixtures("one_thread")
def test_prefill_sharing_measures_two_methods_on_one_prompt(capsys):
    import prefill_sharing

    status = prefill_sharing.main(
        ["--length", "1024", "--methods", "full,streaming_llm", "--max-new-tokens", "4"]
    )
    result = json.loads(capsys.readouterr().out)
    assert status == 0 and result["failed"] == [] and result["n_methods"] == 2
    assert 0 < result["context_length"] <= 1024
    assert result["plain_prefill_s"] > 0 and result["shared_s"] > 0
    assert set(result["compress_s_by_method"]) == {"full", "streaming_llm"}
    # two runs apart pay two prefills; sharing pays one
    assert result["separate_s"] == pytest.approx(
        2 * result["plain_prefill_s"] + result["decode_s"] + result["compress_s"]
    )
