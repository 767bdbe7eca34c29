"""A compact records file from someone else (`scripts/compact_records.py tables`): no record field
chooses where anything is written, and a line of the wrong shape or type is one line naming the file
and the line, exit 2, nothing written (issue 53, S2 and defect 6)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from scripts.compact_records import default_tables_folder, main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "results" / "tiny_example.jsonl.gz"


def tiny_lines() -> tuple[dict, list[dict]]:
    header, *records = (json.loads(line) for line in gzip.open(TINY, "rt") if line.strip())
    return header, records


def write_compact(path: Path, header: dict, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join([json.dumps(header), *lines]) + "\n")
    return path


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def refused(capsys, compact: Path) -> str:
    """The one stderr line `tables` refuses `compact` with, after checking that nothing was written
    beside it (no tables folder)."""
    assert main(["tables", str(compact)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not default_tables_folder(compact).parent.exists()
    return lines[0]


@pytest.mark.parametrize(
    "field, value",
    [
        ("experiment", "{outside}"),  # an absolute folder
        ("experiment", "../../../../../../../../../../../../{outside}"),
        ("job", "../../../../../../../../../../../../{outside}/JOB"),
        ("experiment", "a/b"),
        ("job", ".."),
        ("experiment", 7),
    ],
)
def test_a_records_experiment_or_job_never_names_where_anything_is_written(tmp_path, capsys, field, value):
    outside = tmp_path / "outside"
    outside.mkdir()
    header, records = tiny_lines()
    value = value.format(outside=outside) if isinstance(value, str) else value
    for record in records:
        record[field] = value
    compact = write_compact(tmp_path / "copy.jsonl.gz", header, [json.dumps(r) for r in records])
    line = refused(capsys, compact)
    assert f"{compact} line 2: {field} must be a plain folder name" in line
    assert files_under(outside) == []


PLACEHOLDER = '"<raw>"'


@pytest.mark.parametrize(
    "field, raw, says",
    [
        (None, "[1, 2, 3]", "line 2: a record must be a JSON object, got a JSON list"),
        (None, "{not json", "line 2: not JSON"),
        ("kv_bytes", str(10**400), "line 2: kv_bytes is not a finite number in range"),
        ("score", "1e400", "line 2: score is not a finite number in range"),
        ("score", "NaN", "line 2: score is not a finite number in range"),
        ("score", '"100"', "line 2: score must be a number"),
        ("method", '["full"]', "line 2: method must be text"),
        ("params", "3", "line 2: params must be an object"),
    ],
)
def test_a_record_of_the_wrong_type_is_one_line_naming_the_file_and_line(tmp_path, capsys, field, raw, says):
    header, records = tiny_lines()
    # the first record with `field` set to the raw JSON text (or the whole line raw)
    line = raw if field is None else json.dumps({**records[0], field: "<raw>"}).replace(PLACEHOLDER, raw)
    compact = write_compact(tmp_path / "copy.jsonl.gz", header, [line, *map(json.dumps, records[1:])])
    assert f"{compact} {says}" in refused(capsys, compact)


def test_identities_that_are_not_an_object_are_refused_in_one_line(tmp_path, capsys):
    header, records = tiny_lines()
    compact = write_compact(
        tmp_path / "copy.jsonl.gz", {**header, "identities": "str"}, [json.dumps(r) for r in records]
    )
    assert f"{compact} line 1: identities must be an object" in refused(capsys, compact)


def test_cpus_that_are_not_a_list_of_names_are_refused_in_one_line(tmp_path, capsys):
    header, records = tiny_lines()
    compact = write_compact(
        tmp_path / "copy.jsonl.gz", {**header, "cpus": "AVX2"}, [json.dumps(r) for r in records]
    )
    assert f"{compact} line 1: cpus must be a list of CPU names" in refused(capsys, compact)


def test_a_bad_file_among_several_stops_before_any_is_written(tmp_path, capsys):
    good = tmp_path / "good.jsonl.gz"
    good.write_bytes(TINY.read_bytes())
    header, records = tiny_lines()
    bad = write_compact(tmp_path / "bad.jsonl.gz", header, ["[]", *map(json.dumps, records)])
    assert main(["tables", str(good), str(bad), "--no-figures"]) == 2
    assert "bad.jsonl.gz line 2" in capsys.readouterr().err
    assert not default_tables_folder(good).exists()


def test_published_prints_one_line_per_table_and_figure_and_ends_with_the_count(tmp_path, capsys):
    """Issue 54, item 3: one line per table (its .md, with its .tex) and per figure (its .png, with
    its .pdf), then the count; no table's Markdown printed (before: every table, 1,591 lines)."""
    compact = tmp_path / "tiny_example.jsonl.gz"
    compact.write_bytes(TINY.read_bytes())
    assert main(["tables", str(compact)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    tables = sorted((tmp_path / "tiny_example" / "tables").glob("*.md"))
    figures = sorted((tmp_path / "tiny_example" / "figures").glob("*.png"))
    assert tables and figures
    assert sorted(lines[:-1]) == sorted(
        [f"[table] {path} (and .tex)" for path in tables]
        + [f"[figure] {path} (and .pdf)" for path in figures]
    )
    assert lines[-1] == f"[published] {len(tables)} tables and {len(figures)} figures from 1 compact files"
