"""Arguments that name files: text over 255 bytes, a folder or a binary file given as a file, and a
file test that never raises (issue 39, D1, D10)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_harness import config_error_line
from test_refused_before_loading import one_error_line

import centroidkv.models.loading
from centroidkv.calibrate import read_head_file
from centroidkv.files import is_file
from scripts.generate import main as generate_main

pytestmark = pytest.mark.usefixtures("one_thread")


LONG = "x" * 300  # over NAME_MAX (255 bytes): Path(LONG).is_file() raises ENAMETOOLONG


# ------------------------------------------------------------------ D1. text arguments over 255 bytes
def test_is_file_never_raises():
    assert not is_file(LONG) and not is_file("a\0b") and not is_file("/")


def test_generate_with_a_long_question_reads_it_as_text(tmp_path, monkeypatch, capsys):
    """Before: `--question "why why ..."` (280 bytes) was an OSError [Errno 36] traceback."""
    (tmp_path / "c.txt").write_text("ctx\n")

    def tokenizer_reached(name):
        raise RuntimeError("reached the tokenizer")

    monkeypatch.setattr(centroidkv.models.loading, "load_tokenizer", tokenizer_reached)
    argv = ["--context", str(tmp_path / "c.txt"), "--question", "why " * 70, "--methods", "full"]
    assert generate_main(argv) == 1  # every check passed: the question is text
    assert one_error_line(capsys).endswith("reached the tokenizer")


def test_generate_with_a_long_context_name_is_one_line(no_model_loading, capsys):
    assert generate_main(["--context", LONG, "--methods", "full"]) == 2
    assert one_error_line(capsys) == f"error: --context: no such file: {LONG}"


def test_run_with_a_long_head_file_name_is_one_config_line(tmp_path):
    line = config_error_line(tmp_path, ["method=centroidkv", f"method.params.heads_file={LONG}"])
    assert "heads_file" in line and "does not exist" in line


# ------------------------------------------------------------------ D10. messages that say what is wrong
def test_a_folder_given_as_a_file_says_so(tmp_path, no_model_loading, capsys):
    """Before: "does not exist" / "no such file" for a folder that exists."""
    with pytest.raises(ValueError, match="is a folder, not a file"):
        read_head_file(tmp_path)
    assert generate_main(["--context", str(tmp_path), "--methods", "full"]) == 2
    assert one_error_line(capsys) == f"error: --context: {tmp_path} is a folder, not a file"


def test_a_binary_context_file_is_named(tmp_path, no_model_loading, capsys):
    """Before: "'utf-8' codec can't decode byte 0x80 in position 1", naming no file."""
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"a\x80\xff")
    assert generate_main(["--context", str(binary), "--methods", "full"]) == 2
    assert one_error_line(capsys).startswith(f"error: --context: {binary} is not UTF-8 text")


def test_is_file_accepts_paths(tmp_path):
    (tmp_path / "f").write_text("")
    assert is_file(tmp_path / "f") and not is_file(Path(tmp_path))
