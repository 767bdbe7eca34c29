"""What the wrong answers on multikey tasks gave: another needle's value, a value absent from the
prompt, or none (`eval.benchmarks.ruler.confusion`), counted per method, length and budget.

    python scripts/wrong_answers.py results/long [--out DIR]

Reads the records' `wrong_answer` field (written by the RULER benchmark on its multikey tasks) and
writes `<results>/tables/wrong_answers.md` (and `.tex`): one row per method label, context length and
budget, with the samples, the wrong answers and each kind. A merging method that blends the keys of similar
needles shows it as distractors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.benchmarks.ruler.confusion import KINDS, confusable  # noqa: E402
from scripts.reports.captions import records_words  # noqa: E402
from scripts.reports.table_files import OutputError, output_folder, output_path, write_text  # noqa: E402
from scripts.reports.table_text import markdown_block, to_latex  # noqa: E402
from scripts.reports.tables import context_lengths, load_or_error  # noqa: E402

COLUMNS = ("samples", "wrong", *KINDS)


def multikey_scored(df: pd.DataFrame) -> pd.DataFrame:
    """The scored records of the multikey tasks, those whose wrong answers have a kind."""
    return df[df["ok"] & df["task"].map(confusable)]


def wrong_answer_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Per (label, length, budget) over the scored records of the multikey tasks: the samples, the
    wrong answers and the count of each kind."""
    if "wrong_answer" not in df:
        return pd.DataFrame(columns=["label", "length", "budget", *COLUMNS])
    scored = multikey_scored(df)
    rows = []
    for (label, length, budget), group in scored.groupby(["label", "length", "budget"], sort=False):
        kinds = group["wrong_answer"].dropna()
        counts = {kind: int((kinds == kind).sum()) for kind in KINDS}
        rows.append({"label": label, "length": length, "budget": budget, "samples": len(group),
                     "wrong": int(kinds.size), **counts})  # fmt: skip
    return pd.DataFrame(rows).sort_values(["length", "budget"], kind="stable", ignore_index=True)


CAPTION = (
    "Wrong answers on the multikey tasks: another needle's value (distractor), a value absent "
    "from the prompt's needles, or no value; per method, context length and budget"
)


def caption(df: pd.DataFrame) -> str:
    """CAPTION with the model, the context lengths, the samples behind each row and the head policies
    (`scripts.reports.captions`), as every table of `make published` names them."""
    scored = multikey_scored(df)
    models = ", ".join(sorted(scored["model"].dropna().unique()))
    return f"{CAPTION}; {models}, context {context_lengths(scored)} tokens{records_words(scored)}"


def write_counts(df: pd.DataFrame, folder: Path) -> list[Path]:
    """wrong_answers.md and .tex in `folder` (none when no multikey record has a wrong_answer field)."""
    counts = wrong_answer_counts(df)
    if counts.empty:
        return []
    table = counts.assign(budget=counts["budget"].map("{:g}".format)).set_index("label")
    table.index.name = "method"
    text = caption(df)
    written = [output_path(folder, "wrong_answers.md"), output_path(folder, "wrong_answers.tex")]
    write_text(written[0], markdown_block(text, table, digits=0, bold_best=False))
    write_text(written[1], to_latex(table, text, digits=0, bold_best=False) + "\n")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path, help="folder for the table (default: <results>/tables)")
    args = parser.parse_args(argv)
    df = load_or_error([args.results])
    if isinstance(df, str):
        print(df, file=sys.stderr)
        return 2
    try:
        written = write_counts(df, output_folder(args.out or args.results / "tables"))
    except OutputError as error:
        print(error, file=sys.stderr)
        return 2
    if not written:
        print(f"error: no multikey records with a wrong_answer field under {args.results}", file=sys.stderr)
        return 2
    print(written[0].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
