"""Prompts the model cannot take are one line before any model loads: generate's model, tokens and
context beyond the positions, an empty question among several, calibration beyond the positions
(issue 29, D4, D5, D9; issue 39, D2, D7)."""

from __future__ import annotations

import pytest

import centroidkv.models.loading
from eval import calibrate as eval_calibrate
from scripts.generate import main as generate_main

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------- D4, D5, D9. generate: one line, before loading
def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_generate_with_a_model_that_cannot_be_loaded_is_one_line(monkeypatch, capsys):
    """Before: `--model llama3.1-8b` offline was a RuntimeError traceback (exit 1)."""

    def unreachable(*args, **kwargs):
        raise RuntimeError("cannot load 'meta-llama/Llama-3.1-8B-Instruct' from the Hugging Face Hub")

    monkeypatch.setattr(centroidkv.models.loading, "load_tokenizer", unreachable)
    monkeypatch.setattr(centroidkv.models.loading, "load_model", unreachable)
    assert generate_main(["--prompt", "hi", "--model", "llama3.1-8b", "--methods", "full"]) == 1
    assert one_error_line(capsys) == (
        "error: cannot load the tokenizer of llama3.1-8b: cannot load 'meta-llama/Llama-3.1-8B-Instruct' "
        "from the Hugging Face Hub"
    )
    monkeypatch.setattr(
        centroidkv.models.loading, "load_tokenizer", lambda name: None
    )  # the model itself fails
    monkeypatch.setattr(centroidkv.models.loading, "max_positions", lambda name: None)
    assert generate_main(["--prompt", "hi", "--model", "llama3.1-8b", "--methods", "full"]) == 1
    assert one_error_line(capsys).startswith("error: cannot load llama3.1-8b: cannot load 'meta-llama/")


def test_generate_max_new_tokens_beyond_the_models_positions_is_refused_before_loading(
    no_model_loading, capsys
):
    """Before: the model loaded, then a traceback trying to allocate 768 GB."""
    assert generate_main(["--prompt", "hi", "--max-new-tokens", "1000000000", "--methods", "full"]) == 2
    assert one_error_line(capsys) == (
        "error: --max-new-tokens must be at least 1 and below smollm2-135m's 8192 positions, got 1000000000"
    )


LONG_CONTEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(900))


def test_generate_a_context_beyond_the_models_positions_is_refused_before_loading(
    tmp_path, no_model_loading, capsys
):
    """Before: an 11k-token context on the embedded model (8,192 positions) ran for 5 minutes and
    answered nothing, without a warning."""
    (tmp_path / "context.txt").write_text(LONG_CONTEXT)
    argv = ["--context", str(tmp_path / "context.txt"), "--question", "What jumps?", "--methods", "full"]
    assert generate_main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: the prompt (") and "more than smollm2-135m's 8192" in line
    assert line.endswith("or pass --truncate to cut the middle of the context")


def test_truncate_cuts_the_middle_of_the_context_to_fit():
    from centroidkv.models.prompt_fit import prompt_length, truncate_context

    tokenizer = centroidkv.models.loading.load_tokenizer()
    cut = truncate_context(tokenizer, LONG_CONTEXT, "What jumps?", "full_prompt", 64, 2048)
    assert 2048 - 64 - 8 <= prompt_length(tokenizer, cut, "What jumps?", "full_prompt") <= 2048 - 64
    assert cut.startswith("Line 0: the quick") and cut.endswith(
        "Line 899: the quick brown fox jumps over the lazy dog."
    )
    assert truncate_context(tokenizer, "short", "q", "full_prompt", 64, 2048) == "short"


def test_generate_refuses_a_prompt_beyond_the_positions_before_any_prefill():
    """The Python API too: tiny-llama has 4096 positions."""
    from centroidkv.plan.generate import generate

    model, _ = centroidkv.models.loading.load_model("tiny-llama")
    tokenizer = centroidkv.models.loading.load_tokenizer()
    with pytest.raises(ValueError, match=r"need \d+ positions, more than the model's 4096"):
        generate(model, tokenizer, LONG_CONTEXT, "What jumps?", ["full"], max_new_tokens=4, warm=False)


# ------------------------------------------------------------------ D2. calibration longer than the positions
def test_calibrate_tokens_beyond_the_positions_is_refused_before_loading(tmp_path, no_model_loading, capsys):
    """Before: `--tokens 100000` on the 8,192-position embedded model ran 21 minutes at 0 %."""
    argv = ["--tokens", "100000", "--prompts", "1", "--out", str(tmp_path / "x.json")]
    assert eval_calibrate.main(argv) == 2
    assert one_error_line(capsys) == (
        "calibrate: --tokens 100000 exceeds smollm2-135m's 8192 positions: give at most 8192"
    )
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------ D7. an empty question among several
def test_an_empty_question_among_several_is_named_before_loading(tmp_path, monkeypatch, capsys):
    """Before: the model loaded, then "the chat template splits this context differently"."""
    (tmp_path / "c.txt").write_text("ctx\n")
    monkeypatch.setattr(
        centroidkv.models.loading, "load_tokenizer", lambda name: pytest.fail("tokenizer loaded")
    )
    argv = [
        "--context",
        str(tmp_path / "c.txt"),
        "--question",
        "What?",
        "--question",
        "",
        "--methods",
        "full",
    ]
    assert generate_main(argv) == 2
    assert one_error_line(capsys) == "error: --question number 2 of 2 is empty: give each some text"
