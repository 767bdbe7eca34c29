"""A table as Markdown or LaTeX text: cells formatted per column (counts whole, KV ratios with two
digits), the top tier in bold, every Markdown or LaTeX special character of a record's field escaped."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.reports.latex import latex_escape  # noqa: E402


def _fmt(value, digits: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int,)) or (isinstance(value, float) and value.is_integer() and digits == 0):
        return str(int(value))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


COUNT_COLUMNS = {"n", "failed", "kept all", "Rank", "samples"}
# Columns with their own number of digits.
COLUMN_DIGITS = {"KV": 2}


def bolded(table: pd.DataFrame) -> dict[str, set]:
    """column -> the row labels bolded in it: the compressing methods level with the best of them by
    the paired bootstrap (`top_tier`), set by `make_tables` in `table.attrs["bold"]`. Per-task columns
    and counts are never bolded: a handful of samples per task resolves nothing."""
    return table.attrs.get("bold", {})


def _row_cells(
    table: pd.DataFrame, label, row, bold_cells: dict, digits: int, bold: str, escape=lambda text: text
) -> list[str]:
    """A row's formatted cells, each passed through `escape`; a cell whose row is in its column's top
    tier wrapped in `bold`."""
    cells = []
    for column in table.columns:
        text = escape(_fmt(row[column], 0 if column in COUNT_COLUMNS else COLUMN_DIGITS.get(column, digits)))
        if label in bold_cells.get(column, ()):
            text = bold.format(text)
        cells.append(text)
    return cells


# What a record's text could do in a Markdown table: end its cell (|), escape the next character (a
# backslash), open an HTML tag or autolink (a < before a letter, /, ! or ?; the > that closes it).
# A < or > beside a space or = ("P(> next) >= 0.9", "3 < 10") can open nothing and is kept as it is.
MARKDOWN_SPECIALS = [(re.compile(r"\\"), r"\\\\"), (re.compile(r"\|"), r"\\|"),
                     (re.compile(r"<(?=[A-Za-z/!?])"), "&lt;"), (re.compile(r">(?![\s=])"), "&gt;")]  # fmt: skip


def markdown_escape(text: object) -> str:
    """`text` (made a string) as one table cell or caption line: line breaks become spaces, and what
    MARKDOWN_SPECIALS names, and a leading #, printed as itself, so that a record's field (a variant
    `x<script>...</script>|y|` + newline + `## H`) stays inside its cell."""
    escaped = " ".join(str(text).splitlines())
    for special, printed in MARKDOWN_SPECIALS:
        escaped = special.sub(printed, escaped)
    return "\\" + escaped if escaped.startswith("#") else escaped


def markdown_block(caption: str, table: pd.DataFrame, digits: int = 1, bold_best: bool = True) -> str:
    """The caption in bold, a blank line, the table: a tables/*.md file's text."""
    return f"**{markdown_escape(caption)}**\n\n{to_markdown(table, digits, bold_best)}\n"


def to_markdown(table: pd.DataFrame, digits: int = 1, bold_best: bool = True) -> str:
    """The table in Markdown, every header, label and cell through `markdown_escape`."""
    header = [markdown_escape(table.index.name or "")] + [markdown_escape(c) for c in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(table.columns)) + "|"]
    best = bolded(table) if bold_best else {}
    for label, row in table.iterrows():
        cells = [
            markdown_escape(label),
            *_row_cells(table, label, row, best, digits, "**{}**", markdown_escape),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_latex(table: pd.DataFrame, caption: str, digits: int = 1, bold_best: bool = True) -> str:
    best = bolded(table) if bold_best else {}
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{latex_escape(caption)}}}",
        r"\begin{tabular}{l" + "r" * len(table.columns) + "}",
        r"\toprule",
        " & ".join([latex_escape(table.index.name or "")] + [latex_escape(c) for c in table.columns])
        + r" \\",
        r"\midrule",
    ]
    for label, row in table.iterrows():
        cells = [
            latex_escape(label),
            *_row_cells(table, label, row, best, digits, r"\textbf{{{}}}", latex_escape),
        ]
        lines.append(" & ".join(cells) + r" \\")
        if str(label).startswith("Full"):
            lines.append(r"\midrule")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines)
