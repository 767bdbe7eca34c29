"""A LongBench file whose rows lack a field is one line naming the file and the field (issue 29, D6)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------- D6. a LongBench row without its answers
def test_a_longbench_file_whose_rows_lack_answers_is_one_line_naming_file_and_field(tmp_path):
    """Before: `KeyError: 'answers'` traceback when the samples loaded (after the model)."""
    from eval.benchmarks import build_benchmark
    from eval.benchmarks.longbench.data import load_samples

    rows = [{"input": "Who?", "context": "Ada wrote it.", "length": 3, "_id": str(i)} for i in range(2)]
    (tmp_path / "qasper.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = f"{tmp_path / 'qasper.jsonl'}: row 1: no field 'answers' (a row of qasper has context, input, answers)"
    params = {
        "name": "longbench",
        "tasks": ["qasper"],
        "data_dir": str(tmp_path),
        "lengths": [500],
        "n_samples": 2,
    }
    _, errors = build_benchmark(params)
    assert errors == [f"benchmark.data_dir: {message}"]  # refused with the config, before any model
    with pytest.raises(ValueError) as error:
        load_samples("qasper", None, data_dir=tmp_path)
    assert str(error.value) == message
