"""Head files: a deeply nested one is one line, outliers edited by hand are noticed, the file's
budget is read (issue 39, D8, D10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_refused_before_loading import one_error_line

from centroidkv.calibrate import read_head_file, warn_if_settings_differ

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ D8. a deeply nested head file
def test_a_deeply_nested_head_file_is_one_line(tmp_path):
    """Before: a RecursionError traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="heads_file .*deep.json is not a head file: JSON nested too deeply"):
        read_head_file(deep)


# ------------------------------------------------------------------ D10. the head file's outliers are read
def test_a_head_file_whose_outliers_were_edited_by_hand_says_so(tmp_path, capsys):
    """Before: `outliers` was written but never read: editing it silently did nothing."""
    packaged = (
        Path(__file__).resolve().parent.parent / "centroidkv" / "data" / "outlier_heads_smollm2-135m.json"
    )
    data = json.loads(packaged.read_text())
    read_head_file(packaged)
    assert capsys.readouterr().err == ""  # the shipped file agrees with itself
    data["outliers"] = [[0, 0]]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    read_head_file(edited)
    line = one_error_line(capsys)
    assert line.startswith(f"centroidkv: warning: heads_file {edited}: outliers [[0, 0]] are not the worst")


def test_a_head_files_budget_is_read(tmp_path, capsys):
    """Before: `budget` (the R the errors were measured at) was written and never read: any number
    passed. It is checked, and named when a run's settings differ from the calibration's."""
    packaged = (
        Path(__file__).resolve().parent.parent / "centroidkv" / "data" / "outlier_heads_smollm2-135m.json"
    )
    data = json.loads(packaged.read_text())
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**data, "budget": 7}))
    with pytest.raises(
        ValueError, match=r"budget 7 \(the R its errors were measured at\) must be in \(0, 1\]"
    ):
        read_head_file(edited)
    edited.write_text(json.dumps({**data, "budget": 0.5}))
    warn_if_settings_differ(edited, read_head_file(edited), {**data["method"], "chunk_size": 1})
    assert "calibrated with other settings (at R = 0.5): chunk_size=1" in one_error_line(capsys)
