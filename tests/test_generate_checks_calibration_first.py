"""First use checks before it spends (issue 54, item 4): `scripts/generate.py --model qwen2.5-0.5b`
with a head policy the model has no calibration for is refused in one line, naming the command and
that it takes minutes, before the tokenizer or the model is installed, converted or loaded (before:
190 s of install and conversion, then the refusal)."""

from __future__ import annotations

import pytest

import centroidkv.models.loading
from centroidkv.calibrate import CalibrationMissing
from centroidkv.methods import HeadPolicy, get_method
from scripts.generate import main


def installs(*args, **kwargs):
    raise AssertionError("the model was installed or loaded before the request was checked")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """No user calibration of any model; loading any model fails the test."""
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(centroidkv.models.loading, "load_tokenizer", installs)
    monkeypatch.setattr(centroidkv.models.loading, "load_model", installs)


def test_a_missing_calibration_is_refused_before_the_model_is_installed(empty_cache, capsys):
    argv = ["--model", "qwen2.5-0.5b", "--prompt", "hi", "--methods", "full,centroidkv"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "no clustering head calibration for 'qwen2.5-0.5b'" in lines[0]
    assert "python -m eval.calibrate --model qwen2.5-0.5b --score clustering" in lines[0]
    assert "minutes, depending on the machine" in lines[0]


def check_calibrated(method, model_name: str) -> None:
    """What scripts/generate.py asks of each method before the model is installed."""
    HeadPolicy.of(method).check_calibrated(model_name)


def test_only_what_needs_a_file_is_refused(empty_cache):
    check_calibrated(get_method("centroidkv", heads="none"), "qwen2.5-0.5b")  # no head policy
    check_calibrated(get_method("snapkv"), "qwen2.5-0.5b")
    check_calibrated(get_method("centroidkv"), "smollm2-135m")  # its calibration ships in the package
    check_calibrated(get_method("centroidkv", heads_fraction=0.001), "qwen2.5-0.5b")  # lists no head
    check_calibrated(get_method("centroidkv"), "some-org/not-cached")  # shape unknown: checked at load
    with pytest.raises(CalibrationMissing, match="streaming head calibration for 'qwen2.5-0.5b'"):
        check_calibrated(get_method("duo_attention"), "qwen2.5-0.5b")
