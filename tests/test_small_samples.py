"""Small samples (issue 28, item 6): tables and rankings say in words what their sample cannot resolve
(a step with P(> next) < 0.9, or fewer than 10 samples per method), and counts read in the right
number ("over 1 task"). Records are written by hand into a temporary results folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.reports import ranking, tables


def record(method: str, budget: float, task: str, sample: int, score: float) -> dict[str, Any]:
    return {"benchmark": "ruler", "task": task, "length": 1024, "sample_id": f"{task}-{sample}",
            "method": method, "variant": method, "params": {}, "budget": budget, "status": "ok",
            "score": score, "model": "smollm2-135m", "experiment": "ruler_small"}  # fmt: skip


def write_job(root: Path, records: list[dict[str, Any]]) -> Path:
    folder = root / "ruler_small" / "job"
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder.parent


def ranking_rows(markdown: str) -> dict[tuple[str, str], dict[str, str]]:
    """(budget, method) -> {column: cell} of a ranking table's Markdown."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    rows = [dict(zip(header, (c.strip() for c in line.split("|")[1:-1]), strict=True)) for line in lines[2:]]
    return {(row["Budget"], row["Method"]): row for row in rows}


def test_one_sample_ranking_above_the_full_cache_at_an_equal_score_carries_a_warning(tmp_path, capsys):
    """Before: CentroidKV ranked first above the full cache at an identical 100.0 (P 0.50, n = 1)
    with no word about it, and the summary read "average over 1 tasks"."""
    records = [record("full", 1.0, "niah_single_2", 0, 100.0)]
    for budget, snapkv in ((0.25, 0.0), (0.5, 100.0)):
        records += [record("centroidkv", budget, "niah_single_2", 0, 100.0)]
        records += [record("snapkv", budget, "niah_single_2", 0, snapkv)]
    experiment = write_job(tmp_path, records)
    assert tables.main([str(experiment), "--out", str(tmp_path / "tables")]) == 0
    capsys.readouterr()

    ranking = (tmp_path / "tables" / "ruler_ranking.md").read_text()
    caption = ranking.splitlines()[0]
    assert "Warning: fewer than 10 samples per method at budget 0.25, 0.5" in caption
    rows = ranking_rows(ranking)
    first = rows["0.25", "CentroidKV"]
    assert first["Rank"] == "1-2" and first["P(> next)"] == "0.50"
    assert "level with Full cache" in first["resolved"] and "too few samples (1 < 10)" in first["resolved"]
    # A step the bootstrap calls certain (100 vs 0, P 1.00) is still not resolved by one sample.
    assert rows["0.25", "Full cache"]["P(> next)"] == "1.00"
    assert rows["0.25", "Full cache"]["resolved"] == "too few samples (1 < 10)"

    for name in ("ruler_budget0.25.md", "ruler_budget0.5.md", "ruler_summary.md"):
        caption = (tmp_path / "tables" / name).read_text().splitlines()[0]
        assert "only 1 sample per method (fewer than 10)" in caption, name
    summary = (tmp_path / "tables" / "ruler_summary.md").read_text()
    assert "average over 1 task per budget" in summary and "1 tasks" not in summary
    assert r"\textless{}" in (tmp_path / "tables" / "ruler_ranking.tex").read_text()  # "<" escaped in LaTeX


def test_enough_samples_and_a_clear_lead_are_resolved_without_a_warning(tmp_path, capsys):
    """12 samples, the full cache always right and SnapKV always wrong: every step is resolved, so
    no caption warns and the ranking says "yes"."""
    records = []
    for i in range(12):
        records += [record("full", 1.0, "vt", i, 100.0), record("centroidkv", 0.5, "vt", i, 100.0 * (i % 2))]
        records += [record("snapkv", 0.5, "vt", i, 0.0)]
    experiment = write_job(tmp_path, records)
    assert tables.main([str(experiment), "--out", str(tmp_path / "tables")]) == 0
    capsys.readouterr()
    ranking = (tmp_path / "tables" / "ruler_ranking.md").read_text()
    assert "Warning" not in ranking
    rows = ranking_rows(ranking)
    assert rows["0.5", "Full cache"]["resolved"] == "yes" and rows["0.5", "CentroidKV"]["resolved"] == "yes"
    assert rows["0.5", "SnapKV"]["resolved"] == "-"  # the last row has no step below it
    assert "Warning" not in (tmp_path / "tables" / "ruler_budget0.5.md").read_text()


def test_count_words():
    assert ranking.count_words(1, "task") == "1 task" and ranking.count_words(5, "task") == "5 tasks"
