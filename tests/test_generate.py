"""`python scripts/generate.py`: one-line errors before the model loads, one answer per method and
question (a kvpress press among the methods, two --question) from the command line with --json, every method under one protocol, method
parameters in the method's name, and a method that cannot run answering one line while the others go on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import centroidkv.models.loading
from scripts.generate import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi", "--methods", "nope"], "unknown method 'nope'"),
        (
            ["--prompt", "hi", "--methods", "kvpress:SnapKVPres"],
            "got 'SnapKVPres'; did you mean SnapKVPress?",
        ),
        (["--context", "/no/such/file", "--question", "q"], "--context: no such file"),
        (["--prompt", "hi", "--budget", "1.5"], "budget must be a fraction in (0, 1]"),
        (["--prompt", "hi", "--budget", "0"], "budget must be a fraction in (0, 1]"),
        (["--prompt", "hi", "--model", "nope"], "unknown model 'nope'"),
        (["--prompt", "hi", "--model", "tiny-llama"], "no tokenizer"),
        (["--prompt", "hi", "--methods", "centroidkv(n_recnt=3)"], "unknown parameter(s) n_recnt"),
        (["--prompt", "hi", "--methods", "centroidkv(n_recent=-1)"], "n_recent must be an integer >= 0"),
        (["--prompt", "hi", "--methods", "snapkv:3"], "takes no name:value form"),
        (["--prompt", "hi", "--question", "a", "--question", "b"], "several --question need --context"),
    ],
)
def test_bad_inputs_are_one_line_before_the_model_loads(argv, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(centroidkv.models.loading, "load_model", no_loading)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_one_answer_per_method_and_question_as_json(tmp_path, capsys):
    context = " ".join(f"Line {i}: the river runs quietly past the old mill." for i in range(30))
    context += " The miller's cat is called Pepper."
    (tmp_path / "context.txt").write_text(context)
    questions = ["What runs past the old mill?", "What is the miller's cat called?"]
    argv = [
        "--context",
        str(tmp_path / "context.txt"),
        "--question",
        questions[0],
        "--question",
        questions[1],
    ]
    argv += ["--methods", "full,snapkv,kvpress:SnapKVPress", "--budget", "0.5", "--max-new-tokens", "4"]
    assert main([*argv, "--json"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    methods = ["full", "snapkv", "kvpress:SnapKVPress"]
    assert sorted((a["method"], a["question"]) for a in answers) == sorted(
        (m, q) for m in methods for q in questions
    )  # each method answers each question (from its context compressed once: tests/test_plan_questions.py)
    assert {a["protocol"] for a in answers} == {"context_only"}  # one protocol per call: the context's
    first = {a["method"]: a for a in answers if a["question"] == questions[0]}
    full, snapkv, press = (first[m] for m in methods)
    assert full["kv_ratio"] == pytest.approx(1.0) and snapkv["kv_ratio"] < 0.6 and press["kv_ratio"] < 0.6
    assert snapkv["max_entries"] < full["min_entries"]
    assert all(a["text"] and a["ttft"] > 0 and a["n_generated"] <= 4 for a in answers)
    full_texts = [a["text"] for a in answers if a["method"] == "full"]
    assert full_texts[0] != full_texts[1]  # two questions, two answers


def test_a_whole_prompt_runs_every_method_full_prompt_and_refuses_a_press_alone(capsys):
    prompt = " ".join(f"Line {i}: the river runs quietly past the old mill." for i in range(30))
    argv = ["--prompt", prompt, "--methods", "full,kvpress:SnapKVPress,centroidkv(n_recent=8,heads=none)"]
    assert main([*argv, "--budget", "0.5", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("protocol: full_prompt")
    blocks = {block.split("\n")[0]: block for block in out.split("== ")[1:]}
    press = next(title for title in blocks if title.startswith("kvpress:SnapKVPress"))
    assert "cannot run" in press and "--context and --question" in press and "\n" not in press.strip()
    full = blocks[next(t for t in blocks if t.startswith("full "))]
    assert "the full cache (no budget)" in full and "answer: " in full
    centroidkv = next(t for t in blocks if t.startswith("centroidkv(n_recent=8,heads=none)"))
    assert "answer: " in blocks[centroidkv] and "of the budget's full cache" in blocks[centroidkv]


PROBE = """
import sys
from scripts.generate import main
status = main(sys.argv[1:])
print("exit", status, "torch" in sys.modules, file=sys.stderr)
"""


def test_a_bad_method_or_value_is_one_line_with_a_hint_without_importing_torch():
    root = Path(__file__).resolve().parent.parent

    def probe(*argv: str) -> list[str]:
        command = [sys.executable, "-c", PROBE, "--prompt", "hi", *argv]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
        return done.stderr.strip().splitlines()

    probe("--methods", "nope")  # the first run may build the schema's cache (that one imports torch)
    for argv, fragment in [
        (["--methods", "centroidkvv"], "did you mean centroidkv?"),
        (["--methods", "full,centroidkv(heads=wholee)"], "got 'wholee'; did you mean whole?"),
        (["--methods", "snapkv(windw_size=8)"], "did you mean window_size?"),
        (["--model", "tiny-lama"], "did you mean tiny-llama?"),
        (["--budget", "2"], "budget must be a fraction in (0, 1]"),
    ]:
        error, status = probe(*argv)
        assert error.startswith("error: ") and fragment in error, (argv, error)
        assert status == "exit 2 False", argv  # exit status 2, and torch never imported
