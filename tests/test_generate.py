"""`python -m centroidkv.generate`: one-line errors before the model loads, and one answer per method
(a kvpress press with its own prefill among them) from the command line with --json."""

from __future__ import annotations

import json

import pytest

import centroidkv.models
from centroidkv.generate import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi", "--methods", "nope"], "unknown method 'nope'"),
        (["--prompt", "hi", "--methods", "kvpress:NoSuchPress"], "unknown press 'NoSuchPress'"),
        (["--context", "/no/such/file", "--question", "q"], "--context: no such file"),
        (["--prompt", "hi", "--budget", "1.5"], "budget must be a fraction in (0, 1]"),
        (["--prompt", "hi", "--budget", "0"], "budget must be a fraction in (0, 1]"),
        (["--prompt", "hi", "--model", "nope"], "unknown model 'nope'"),
        (["--prompt", "hi", "--model", "tiny-llama"], "no tokenizer"),
    ],
)
def test_bad_inputs_are_one_line_before_the_model_loads(argv, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(centroidkv.models, "load_model", no_loading)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_one_answer_per_method_as_json(tmp_path, capsys):
    context = " ".join(f"Line {i}: the river runs quietly past the old mill." for i in range(30))
    (tmp_path / "context.txt").write_text(context)
    argv = ["--context", str(tmp_path / "context.txt"), "--question", "What runs past the old mill?"]
    argv += ["--methods", "full,snapkv,kvpress:SnapKVPress", "--budget", "0.5", "--max-new-tokens", "4"]
    assert main([*argv, "--json"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["method"] for a in answers] == ["full", "snapkv", "kvpress:SnapKVPress"]
    assert [a["protocol"] for a in answers] == ["full_prompt", "full_prompt", "context_only"]
    full, snapkv, press = answers
    assert full["kv_ratio"] == pytest.approx(1.0) and snapkv["kv_ratio"] < 0.6 and press["kv_ratio"] < 0.6
    assert snapkv["max_entries"] < full["min_entries"]
    assert all(a["text"] and a["ttft_s"] > 0 and a["n_generated"] <= 4 for a in answers)
