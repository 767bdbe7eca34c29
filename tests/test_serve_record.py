"""The committed record of the full `make serve-bench` (results/serve_bench.json.gz) against the table
docs/vllm.md prints from it: every engine's measures follow from its per-step trace, every cell of the
table from those measures (scripts/serve_bench.py's own formats); and the rows a run plans."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import serve_bench  # noqa: E402

from tests.test_published_numbers import markdown_table  # noqa: E402

RECORD = ROOT / "results" / "serve_bench.json.gz"
TABLE_AFTER = "- `make serve-bench` (the full workload"


def load_record() -> dict:
    return json.loads(gzip.decompress(RECORD.read_bytes()))


def test_the_record_is_the_full_workload():
    settings = load_record()["settings"]
    assert not settings["quick"]
    assert (settings["requests"], settings["prompt_tokens"], settings["new_tokens"]) == (16, 2048, 512)


def test_each_engines_measures_follow_from_its_trace():
    record = load_record()
    for row in record["rows"]:
        assert serve_bench.measures(row["trace"], record["settings"]["new_tokens"]) == row["measures"], row[
            "engine"
        ]


def test_docs_table_is_the_records():
    rows = load_record()["rows"]
    published = markdown_table(ROOT / "docs" / "vllm.md", TABLE_AFTER)
    assert len(published) == len(rows)
    stock = rows[0]["measures"]
    for cells, row in zip(published, rows, strict=True):
        measured = row["measures"]
        for key, title, fmt in serve_bench.COLUMNS:
            value = measured[key] * 1000 if key == "tpot_s" else measured[key]
            assert cells[title] == fmt.format(value), (cells["engine"], title)
        for key, title in serve_bench.RATIOS:
            assert cells[title] == f"{measured[key] / stock[key]:.2f}", (cells["engine"], title)


def test_quick_bench_rows_are_stock_then_each_budget_under_both_head_policies(capsys):
    rows = serve_bench.row_plan(serve_bench.parse_args(["--quick"]))
    assert rows == [
        (None, False, "none"),
        (0.25, False, "none"),
        (0.25, False, "whole"),
        (0.125, False, "none"),
        (0.125, False, "whole"),
    ]
    full = serve_bench.row_plan(serve_bench.parse_args(["--heads", "whole"]))
    assert [heads for _, _, heads in full] == ["none", "whole", "whole", "whole", "none"]  # stock, 3 R, own
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--heads", "budget"])
    assert "--heads 'budget'" in capsys.readouterr().err


def test_the_bench_runs_in_bf16_only_where_the_cpu_computes_in_it(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert serve_bench.native_dtype(str(cpuinfo)) == "float32"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert serve_bench.native_dtype(str(cpuinfo)) == "bfloat16"
    assert serve_bench.native_dtype(str(tmp_path / "absent")) == "float32"
    # the pool is sized in the rows' dtype: 2 layers x 2 KV heads x 64 x (K, V) x 2 or 4 bytes
    shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    assert serve_bench.bytes_per_token(str(tmp_path)) == 1024
    assert serve_bench.bytes_per_token(str(tmp_path), "float32") == 2048
