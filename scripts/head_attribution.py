"""What a head policy adds, and what clustering adds, from a head-policy factorial (make ablate / heads).

    python scripts/head_attribution.py results/heads [--choose-on results/ablate_heads] [--out DIR]

Reads the records of a job whose methods run under several head policies (`heads`: none, whole,
budget; one `heads_file` for all) and writes, per budget, two tables to `<results>/tables/`
(`heads_attribution.md`):

- **Heads over none**: each method's average under every policy, its best policy, and what that
  policy adds over none with P(best > none), the paired bootstrap of `scripts/tables.py`.
- **Clustering over each method**: CentroidKV under its best policy against every other method under
  its own best policy, the difference and P(CentroidKV > method).

The best policy of a method is chosen on `--choose-on` (the dev factorial) when given, so that the
test numbers are not the maximum of three noisy ones; otherwise on the records themselves (say so).
A lead with P below 0.9, or on fewer than 10 samples, is not resolved
(`scripts.reports.ranking.resolved_words`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from centroidkv.head_policy import HEAD_POLICIES  # noqa: E402
from scripts.reports.ranking import bootstrap, p_above, resolved_words  # noqa: E402
from scripts.reports.table_files import write_text  # noqa: E402
from scripts.reports.table_text import markdown_block  # noqa: E402
from scripts.reports.tables import load_or_error  # noqa: E402

CLUSTERING = "centroidkv"


def factorial_cells(df: pd.DataFrame) -> pd.DataFrame:
    """The records of the factorial, with `method` and `policy` columns: every run whose head policy is
    one of HEAD_POLICIES and, where it lists heads, reads the head file most runs of the job read."""
    runs = df[df["method"] != "full"].copy()
    runs["policy"] = runs["params"].map(lambda p: p.get("heads", "none"))
    runs["score_file"] = runs["params"].map(lambda p: p.get("heads_file"))
    listed = runs[runs["policy"] != "none"]
    if listed.empty:
        return runs.iloc[0:0]
    common = listed["score_file"].mode().iloc[0]
    keep = (runs["policy"] == "none") | (runs["score_file"] == common)
    runs = runs[keep & runs["policy"].isin(HEAD_POLICIES)]
    # one variant per (method, policy): the factorial's own
    counts = runs.groupby(["method", "policy"])["label"].nunique()
    return runs[runs.set_index(["method", "policy"]).index.map(lambda k: counts[k] == 1)]


def best_policies(df: pd.DataFrame, budget: float) -> dict[str, str]:
    """method -> the policy with the highest average score at `budget` (ties: none, whole, budget)."""
    cells = factorial_cells(df)
    cells = cells[cells["ok"] & (cells["budget"] == budget)]
    means = cells.groupby(["method", "policy"])["score"].mean()
    best = {}
    for method in means.index.get_level_values(0).unique():
        scores = means[method]
        best[method] = max(
            HEAD_POLICIES, key=lambda p: (scores.get(p, float("-inf")), -HEAD_POLICIES.index(p))
        )
    return best


def paired(
    df: pd.DataFrame, budget: float, labels: list[str]
) -> tuple[dict[str, float], float | None, int] | None:
    """The paired bootstrap of `labels` alone at `budget`, on the samples they all finished (a capped
    method is compared on its own samples, not cut to the fewest of the job): (label -> mean,
    P(first > second) or None for one label, samples), or None when they share no sample."""
    found = bootstrap(df, budget, labels=labels)
    if found is None:
        return None
    names, means, per_draw, _, n_samples = found
    column = {label: i for i, label in enumerate(names)}
    p = p_above(per_draw, column[labels[0]], column[labels[1]]) if len(labels) > 1 else None
    return {label: means[column[label]] for label in names}, p, n_samples


def _policy_row(df: pd.DataFrame, budget: float, method: str, variant: dict, chosen: str) -> dict:
    """One method's average under each head policy (on the samples its policies share), its best
    policy and what that adds over none."""
    labels = [variant[method, policy] for policy in HEAD_POLICIES if (method, policy) in variant]
    top, none = variant.get((method, chosen)), variant.get((method, "none"))
    if top in labels and none in labels:  # the pair compared first, so that P is P(top > none)
        labels = [top, none, *(label for label in labels if label not in (top, none))]
    found = paired(df, budget, labels)
    means, p, n_samples = found if found is not None else ({}, None, 0)
    row = {"Method": method}
    for policy in HEAD_POLICIES:
        row[policy] = means.get(variant.get((method, policy)), float("nan"))
    row["best"] = chosen
    compared = chosen != "none" and top in means and none in means and p is not None
    row["heads add"] = means[top] - means[none] if compared else 0.0
    row["P(best > none)"] = f"{p:.2f}" if compared else "-"
    row["samples"] = n_samples
    return row


def _clustering_row(
    df: pd.DataFrame, budget: float, clustering: tuple[str, str], other: tuple[str, str]
) -> dict | None:
    """CentroidKV under its best policy against another method under its own, on the samples both
    finished; each side given as (label, name shown: "method (policy)")."""
    found = paired(df, budget, [clustering[0], other[0]])
    if found is None:
        return None
    means, p, n_samples = found
    return {
        "Method (best policy)": other[1],
        "avg": means[other[0]],
        clustering[1]: means[clustering[0]],
        "clustering adds": means[clustering[0]] - means[other[0]],
        "P": f"{p:.2f}",
        "resolved": resolved_words(p, n_samples),
        "samples": n_samples,
    }


def attribution(df: pd.DataFrame, chooser: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """name -> table for every budget (see the module)."""
    cells = factorial_cells(df)
    tables = {}
    for budget in sorted(cells["budget"].unique()):
        at_budget = cells[cells["budget"] == budget]
        variant = {
            (m, p): label
            for m, p, label in zip(at_budget["method"], at_budget["policy"], at_budget["label"], strict=True)
        }
        best = best_policies(chooser if chooser is not None else df, budget)
        methods = list(dict.fromkeys(at_budget["method"]))
        chosen = {method: best.get(method, "none") for method in methods}
        rows = [_policy_row(df, budget, method, variant, chosen[method]) for method in methods]
        if not any(row["samples"] for row in rows):
            continue
        own_policy = chosen.get(CLUSTERING, "none")
        clustering = (variant.get((CLUSTERING, own_policy)), f"{CLUSTERING} ({own_policy})")
        versus = [
            _clustering_row(df, budget, clustering, (variant[method, policy], f"{method} ({policy})"))
            for method, policy in chosen.items()
            if method != CLUSTERING and clustering[0] is not None and (method, policy) in variant
        ]
        versus = [row for row in versus if row is not None]
        policy_table = pd.DataFrame(rows).set_index("Method")
        policy_table.attrs["bold"] = {}
        tables[f"{budget:g} heads"] = policy_table
        if versus:
            tables[f"{budget:g} clustering"] = pd.DataFrame(versus).set_index("Method (best policy)")
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="an experiment folder (e.g. results/heads)")
    parser.add_argument(
        "--choose-on", type=Path, help="the dev factorial that chooses each method's best policy"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: <results>/tables)")
    args = parser.parse_args(argv)
    df = load_or_error([args.results])
    chooser = load_or_error([args.choose_on]) if args.choose_on else None
    for loaded in (df, chooser):
        if isinstance(loaded, str):
            print(loaded, file=sys.stderr)
            return 2
    tables = attribution(df, chooser)
    if not tables:
        print(f"error: no head-policy factorial in {args.results}", file=sys.stderr)
        return 2
    chosen = (
        f"best policy chosen on {args.choose_on}" if args.choose_on else "best policy chosen on these records"
    )
    parts = []
    for name, table in tables.items():
        budget, kind = name.split()
        caption = (
            f"What a head policy adds over none at budget {budget} ({chosen}; each row paired on the samples its policies share)"
            if kind == "heads"
            else f"What clustering adds over each method's best head policy at budget {budget} (each row paired on the samples both share)"
        )
        parts.append(markdown_block(caption, table, 1, bold_best=False))
    text = "\n".join(parts)
    print(text)
    out = args.out or args.results / "tables"
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "heads_attribution.md", text)
    print(f"[head_attribution] written to {out / 'heads_attribution.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
