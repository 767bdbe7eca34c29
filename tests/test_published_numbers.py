"""The numbers docs/results.md publishes (the README summarises its headline tables), regenerated
from the compact records committed under results/ (`scripts/compact_records.py`) and compared cell by
cell: a published table that its records no longer give fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.compact_records import expand
from scripts.reports.tables import load, score_table

ROOT = Path(__file__).resolve().parent.parent
FRACTIONS = {"1/16": 0.0625, "1/8": 0.125, "1/4": 0.25, "1/2": 0.5, "3/4": 0.75}
VARIANT_PREFIX = {"CentroidKV": "centroidkv", "K-Means": "kmeans", "SnapKV": "snapkv",
                  "StreamingLLM": "streaming_llm", "H2O": "h2o"}  # fmt: skip

# (document, the line that the table follows, the compact records behind it[, the budget of a table
# whose columns name none])
PUBLISHED = [
    ("docs/results.md", "#### 8k tokens (`make long`", "results/long_study_8k.jsonl.gz"),
    ("docs/results.md", "#### 16k tokens (`make long`", "results/long_study_16k.jsonl.gz"),
    ("docs/results.md", "#### 32k tokens (`make long`", "results/long_study_32k.jsonl.gz"),
    ("docs/results.md", "### 16k tokens: the pilot", "results/long.jsonl.gz"),
    ("docs/results.md", "### 8k tokens (`experiment=ruler_long`", "results/ruler_long-8k-qwen2.5-0.5b.jsonl.gz"),
    ("docs/results.md", "### 32k tokens (`experiment=ruler_long`", "results/ruler_long-32k-qwen2.5-0.5b.jsonl.gz"),
    ("docs/results.md", "### Qwen2.5-Coder-1.5B at 4k", "results/ruler_long-4k-qwen2.5-1.5b.jsonl.gz"),
    ("docs/results.md", "### 4k tokens: the head-policy factorial", "results/heads-qwen2.5-0.5b.jsonl.gz"),
    ("docs/results.md", "### SmolLM2, 4k: the heads carry the lead", "results/heads.jsonl.gz"),
    ("docs/results.md", "### The paper's table (`make reproduce-ruler`", "results/reproduce_ruler_cpu.jsonl.gz"),
    ("docs/results.md", "### The factorial on test (`make heads`)", "results/heads.jsonl.gz"),
    ("docs/results.md", "### The factorial on dev (`make ablate`)", "results/ablate_heads.jsonl.gz"),
    ("docs/results.md", "### 1/16 of the bytes (`make heads`", "results/heads_low.jsonl.gz", 0.0625),
    ("docs/results.md", "In parentheses, the two whole-head variants", "results/heads_low_whole.jsonl.gz", 0.0625),
    ("docs/results.md", "## The kvpress zoo with head policies", "results/kvpress_zoo.jsonl.gz"),
    ("docs/results.md", "## CentroidKV's own ablation on dev", "results/ablate_centroidkv.jsonl.gz"),
    ("docs/results.md", "RULER, the 5 reproduce tasks. Score", "results/precision.jsonl.gz"),
    ("docs/results.md", "*Table: SmolLM2-135M in bf16, RULER 4k, test split, 25 samples per cell, rerun", "results/precision-avx512.jsonl.gz"),
    ("docs/results.md", "NIAH (one needle at depths", "results/precision_niah.jsonl.gz"),
    ("docs/results.md", "*Table: SmolLM2-135M in bf16, NIAH 4k, test split, 9 samples per cell, rerun", "results/precision_niah-avx512.jsonl.gz"),
    ("docs/results.md", "## CentroidKV's merge fraction r_init", "results/sweep_r.jsonl.gz"),
]  # fmt: skip


# The headline tables (docs/results.md, "At a glance"): those the README summarises.
HEADLINE = ("### SmolLM2, 4k: the heads carry the lead", "### The paper's table")


def markdown_table(document: Path, after: str) -> list[dict[str, str]]:
    """The first markdown table after the line that starts with `after`, as rows of header -> cell
    (a table indented inside a list item too)."""
    lines = [line.strip() for line in document.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, row, strict=True)) for row in body]


def published_cells(rows: list[dict[str, str]], budget: float | None) -> dict[tuple[str, float], float]:
    """(label, budget) -> the published average: `policy 1/8` columns name `<method>-<policy>` variants,
    plain `1/8` (or `Avg 1/8`) columns the method's own label; a table of one budget has `policy`
    columns only. A cell in parentheses comes from another job and is not compared; a row's note in
    parentheses is not part of its label, except " (kvpress)", which names a press, and a parameter's
    value such as " (r_init=0.1)". A table with `R`
    and `score` columns has one row per method and budget."""
    cells = {}
    for row in rows:
        method = row.get("method", row.get("Method", ""))
        name = re.sub(
            r"\*|\s+\((?!kvpress\))(?![^)]*=)[^)]*\)", "", method
        ).strip()  # keeps " (kvpress)", "(r=1)"
        if "R" in row and "score" in row:
            cells[name, float(row["R"])] = float(row["score"])
            continue
        for column, text in row.items():
            found = re.fullmatch(r"(?:Avg )?(none|whole|budget)?(?: ?(\d/\d+|0\.\d+))?", column)
            if found is None or not any(found.groups()) or not text or text.startswith("("):
                continue
            policy, fraction = found.groups()
            at = budget if fraction is None else FRACTIONS[fraction] if "/" in fraction else float(fraction)
            label = f"{VARIANT_PREFIX[name]}-{policy}" if policy else name
            cells[label, at] = float(re.sub(r"\*|\(.*\)", "", text))
    return cells


@pytest.mark.parametrize("published", PUBLISHED, ids=lambda entry: f"{entry[0]}: {entry[1][:40]}")
def test_a_published_table_is_what_its_committed_records_give(tmp_path, published):
    document, after, compact, *budget = published
    cells = published_cells(markdown_table(ROOT / document, after), *budget or [None])
    expand(ROOT / compact, tmp_path)
    df = load([tmp_path])
    assert cells, "no cell read from the table"
    for budget in sorted({budget for _, budget in cells}):
        averages = score_table(df, budget)["Avg"]
        for (label, at), published in cells.items():
            if at == budget:
                assert round(float(averages[label]), 1) == published, (document, label, budget)


def test_the_one_command_regenerates_every_headline_table_from_the_compact_files_alone(tmp_path):
    """`rm -rf results/*/ && make published`: the tables it writes from the committed compact files
    (nothing else under results/) hold every number of the headline tables (docs/results.md, "At a
    glance", which the README summarises), and it draws the figures."""
    from scripts.compact_records import default_tables_folder, main

    headline = [entry for entry in PUBLISHED if entry[1].startswith(HEADLINE)]
    assert len(headline) == 2
    copies = []
    for _, _, compact, *_ in headline:
        copies.append(tmp_path / Path(compact).name)
        copies[-1].write_bytes((ROOT / compact).read_bytes())
    assert main(["tables", *map(str, copies)]) == 0
    for (document, after, _, *budget), copy in zip(headline, copies, strict=True):
        cells = published_cells(markdown_table(ROOT / document, after), *budget or [None])
        assert cells, "no cell read from the table"
        written = default_tables_folder(copy)
        assert list((written.parent / "figures").glob("*_accuracy_vs_budget.png")), "no figure drawn"
        for (label, at), published in cells.items():
            rows = markdown_table(written / f"ruler_budget{at:g}.md", "**")
            averages = {row["Method"]: float(row["Avg"].strip("*")) for row in rows}
            assert averages[label] == published, (document, label, at)
