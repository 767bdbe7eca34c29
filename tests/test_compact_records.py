"""Issue 40, item 1: the tables regenerate from committed compact records. results/
tiny_example.jsonl.gz was exported from a real tiny-llama job (its first line names the commit and the
command); tests/fixtures/tiny_example_tables/ holds the tables `scripts/tables.py` wrote from the full
records of that job. Regenerating from the compact file alone must give every number again."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from eval.compact_store import read_compact
from scripts import compact_records

ROOT = Path(__file__).resolve().parent.parent
COMPACT = ROOT / "results" / "tiny_example.jsonl.gz"
EXPECTED = ROOT / "tests" / "fixtures" / "tiny_example_tables"


def test_every_table_regenerates_from_the_committed_compact_records(tmp_path):
    assert compact_records.main(["tables", str(COMPACT), "--out", str(tmp_path)]) == 0
    expected = sorted(path.name for path in EXPECTED.glob("*.md"))
    assert expected and sorted(path.name for path in tmp_path.glob("*.md")) == expected
    for name in expected:
        assert (tmp_path / name).read_text() == (EXPECTED / name).read_text(), name


def test_the_compact_file_names_its_commit_and_command_and_keeps_only_table_fields():
    with gzip.open(COMPACT, "rt") as handle:
        header, *records = (json.loads(line) for line in handle)
    assert header["command"].startswith("python scripts/run.py") and len(header["commit"]) == 40
    assert records and all(set(r) <= set(compact_records.COMPACT_FIELDS) for r in records)
    assert "prediction" not in records[0] and "references" not in records[0]


def test_export_then_tables_round_trip_and_a_wrong_file_is_one_line(tmp_path, capsys):
    expanded = compact_records.expand(COMPACT, tmp_path / "jobs")
    again = tmp_path / "again.jsonl.gz"
    assert (
        compact_records.export([tmp_path / "jobs"], again, "again")
        == 15
        == len((expanded[0] / "records.jsonl").read_text().splitlines())
    )
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as handle:
        handle.write('{"not": "compact"}\n')
    assert compact_records.main(["tables", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {bad} line 1: not a compact records file (a first line with compact: 1)"
    )
    with pytest.raises(ValueError):
        compact_records.expand(bad, tmp_path / "x")


def test_export_names_the_commit_the_jobs_ran_on_not_the_exporting_checkout(tmp_path):
    jobs = compact_records.expand(COMPACT, tmp_path / "jobs")
    (jobs[0] / "env.json").write_text(json.dumps({"git_commit": "a" * 40}))
    out = tmp_path / "out.jsonl.gz"
    compact_records.export([tmp_path / "jobs"], out, "make something")
    with gzip.open(out, "rt") as handle:
        assert json.loads(handle.readline())["commit"] == "a" * 40
    second = jobs[0].parent / "another-job"
    second.mkdir()
    (second / "env.json").write_text(json.dumps({"git_commit": "b" * 40}))
    with pytest.raises(ValueError, match="2 commits"):
        compact_records.export([tmp_path / "jobs"], out, "make something")
    assert compact_records.export([tmp_path / "jobs"], out, "make something", commit="c" * 40) > 0
    with gzip.open(out, "rt") as handle:
        assert json.loads(handle.readline())["commit"] == "c" * 40


def test_the_compact_file_names_every_cpu_its_records_ran_on(tmp_path):
    """Greedy answers can differ in their last bits between CPUs (docs/results.md): env.json names the
    CPU, a resumed job keeps its earlier runs' CPUs, and the compact file lists them all."""
    from eval.job_store import JobStore
    from eval.records import cpu_name

    assert cpu_name()  # this machine's, e.g. "Intel(R) Xeon(R) Processor @ 2.80GHz (AVX512)"
    jobs = compact_records.expand(COMPACT, tmp_path / "jobs")
    store = JobStore(jobs[0])
    for cpu in ("AMD EPYC (AVX2)", "Intel Xeon (AVX512)", "Intel Xeon (AVX512)"):
        store.prepare("config", {"git_commit": "a" * 40, "cpu": cpu})
    env = json.loads((jobs[0] / "env.json").read_text())
    assert env["cpu"] == "Intel Xeon (AVX512)" and env["earlier_cpus"] == ["AMD EPYC (AVX2)"]
    out = tmp_path / "out.jsonl.gz"
    compact_records.export([tmp_path / "jobs"], out, "make something")
    header, _ = read_compact(out)
    assert header["cpus"] == ["AMD EPYC (AVX2)", "Intel Xeon (AVX512)"]


def test_a_job_resumed_on_another_commit_keeps_the_earlier_one(tmp_path):
    """Before, a resumed job's env.json named only the commit of its last run, so records computed on
    the earlier commit were exported as the later one's (the 16k study: started at 6cc38ff)."""
    from eval.job_store import JobStore

    jobs = compact_records.expand(COMPACT, tmp_path / "jobs")
    store = JobStore(jobs[0])
    store.prepare("config", {"git_commit": "a" * 40})
    store.prepare("config", {"git_commit": "b" * 40})
    store.prepare("config", {"git_commit": "b" * 40})
    env = json.loads((jobs[0] / "env.json").read_text())
    assert env["git_commit"] == "b" * 40 and env["earlier_git_commits"] == ["a" * 40]
    with pytest.raises(ValueError, match="2 commits"):
        compact_records.export([tmp_path / "jobs"], tmp_path / "out.jsonl.gz", "make something")
