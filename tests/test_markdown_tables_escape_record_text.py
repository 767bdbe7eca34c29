"""Markdown tables print a record's text, never run it (issue 53, defect 5): a variant holding a
cell separator, an HTML tag, a line break and a heading stays inside its cell."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from scripts.compact_records import main
from scripts.reports.table_text import markdown_escape

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "x<script>alert(1)</script>|y|\n## H"


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)(?:\\\\)*\|", line))


def test_a_hostile_variant_stays_inside_its_cell_in_every_markdown_table(tmp_path):
    lines = gzip.open(ROOT / "results" / "tiny_example.jsonl.gz", "rt").read().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    for record in records:
        if record["method"] == "centroidkv":
            record["variant"] = HOSTILE
    compact = tmp_path / "hostile.jsonl.gz"
    with gzip.open(compact, "wt") as handle:
        handle.write("\n".join([lines[0], *map(json.dumps, records)]) + "\n")
    assert main(["tables", str(compact), "--out", str(tmp_path / "tables"), "--no-figures"]) == 0
    tables = sorted((tmp_path / "tables").glob("*.md"))
    assert tables
    shown = 0
    for table in tables:
        text = table.read_text()
        assert "<script>" not in text and not re.search(r"^\s*#", text, flags=re.M), table.name
        rows = [line for line in text.splitlines() if line.startswith("|")]
        assert len({unescaped_pipes(row) for row in rows}) == 1, (table.name, rows)  # no row broken
        shown += sum(r"x&lt;script&gt;alert(1)&lt;/script&gt;\|y\| ## H" in row for row in rows)
    assert shown, "the variant's row is missing"


def test_markdown_escape_keeps_plain_text_and_escapes_each_special():
    assert markdown_escape("CentroidKV (heads=whole) @ 0.25") == "CentroidKV (heads=whole) @ 0.25"
    assert markdown_escape("# a\\|b\nc") == r"\# a\\\|b c"
