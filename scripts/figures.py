"""The paper's figures from any set of results, as PNG + PDF under paper_figures/.

  python scripts/figures.py results/reproduce_ruler_cpu
  python scripts/figures.py results/*/ --out paper_figures

Figures (each drawn when the records hold what it needs), named <experiment>_<figure>:
  ruler_accuracy_vs_budget  RULER average score vs budget per method (full cache dashed), and per
                            task family;
  niah_heatmap              needle retrieval, depth x context length, one panel per method@budget;
  speed_vs_context          TPOT and KV cache size vs context length per method;
  score_vs_r                RULER average vs CentroidKV's r schedule, one line per budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from scripts.tables import load_or_error  # noqa: E402

FAMILIES = {
    "Single NIAH": ("niah_single_1", "niah_single_2", "niah_single_3"),
    "Multi-key NIAH": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
    "Multi-value / multi-query NIAH": ("niah_multivalue", "niah_multiquery"),
    "Variable tracking": ("vt",),
    "Aggregation (CWE, FWE)": ("cwe", "fwe"),
    "QA": ("qa_1", "qa_2"),
}
MARKERS = "osv^D<>pPX*h"


def _style(rank: int) -> dict:
    """Colour and marker of the method ranked `rank` in the records (tables.load's method_rank)."""
    rank = max(0, int(rank))
    return dict(color=f"C{rank % 10}", marker=MARKERS[rank % len(MARKERS)])


def _save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def _task_means(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score per (label, budget, task) over successful samples; a label is one method or variant."""
    ok = df[df["ok"]]
    keys = ["method", "method_rank", "label", "budget", "task"]
    return ok.groupby(keys, as_index=False)["score"].mean()


def _subtitle(df: pd.DataFrame) -> str:
    models = ", ".join(sorted(df["model"].dropna().unique()))
    lengths = ", ".join(
        f"{int(x) // 1024}k" if x >= 1024 else str(int(x)) for x in sorted(df["length"].dropna().unique())
    )
    n = df[df["ok"]].groupby(["task", "label", "budget"]).size()
    per_task = f"{int(n.min())}" if n.min() == n.max() else f"{int(n.min())}-{int(n.max())}"
    return f"{models}, context {lengths} tokens, {per_task} sample{'s' if per_task != '1' else ''} per task"


def _accuracy_axes(ax, means: pd.DataFrame, tasks: tuple[str, ...] | None, title: str) -> bool:
    part = means if tasks is None else means[means["task"].isin(tasks)]
    if part.empty:
        return False
    n_tasks = part["task"].nunique()
    # Average over tasks, only for (method, budget) points that have every task.
    avg = (
        part.groupby(["method", "method_rank", "label", "budget"])
        .agg(score=("score", "mean"), n=("task", "nunique"))
        .reset_index()
    )
    avg = avg[avg["n"] == n_tasks]
    budgets = sorted(avg.loc[avg["method"] != "full", "budget"].unique())
    n_lines = avg.loc[avg["method"] != "full", "label"].nunique()
    spread = 0.08 * (max(budgets) - min(budgets) if len(budgets) > 1 else 0.25)
    line = 0
    for (method, rank, label), rows in avg.sort_values(["method_rank", "label"]).groupby(
        ["method", "method_rank", "label"], sort=False
    ):
        rows = rows.sort_values("budget")
        if method == "full":
            ax.axhline(
                rows["score"].mean(),
                color="black",
                linestyle="--",
                linewidth=1.2,
                label=f"{label} (no compression)",
                zorder=5,
            )
            continue
        # Dodge: equal scores would hide each other, so each line is shifted a little sideways.
        offset = (line - (n_lines - 1) / 2) * spread / max(1, n_lines - 1)
        ax.plot(
            rows["budget"] + offset, rows["score"], label=label, linewidth=1.6, markersize=6, **_style(rank)
        )
        line += 1
    ax.set_title(title, fontsize=11)
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:.0%}" for b in budgets])
    ax.set_xlabel("KV cache budget (fraction of prompt + generation)")
    ax.set_ylabel("Score (0-100)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    return True


def accuracy_vs_budget(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    ruler = df[df["benchmark"] == "ruler"]
    if ruler.empty or ruler.loc[ruler["method"] != "full", "budget"].nunique() < 1:
        return []
    means = _task_means(ruler)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.6))
    tasks = ", ".join(sorted(ruler["task"].unique()))
    _accuracy_axes(ax, means, None, f"RULER average score vs KV budget\n{_subtitle(ruler)}")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), title="Method")
    ax.text(
        0.5,
        -0.2,
        f"tasks: {tasks}; methods are offset slightly along x so that equal scores stay visible",
        transform=ax.transAxes,
        ha="center",
        va="top",
        fontsize=7,
        color="dimgray",
        wrap=True,
    )
    paths += _save(fig, out, f"{prefix}ruler_accuracy_vs_budget")

    families = [(name, tasks) for name, tasks in FAMILIES.items() if ruler["task"].isin(tasks).any()]
    if len(families) > 1:
        cols = min(3, len(families))
        rows = (len(families) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False, sharey=True)
        for ax, (name, tasks) in zip(axes.flat, families, strict=False):
            present = [t for t in tasks if t in set(ruler["task"])]
            _accuracy_axes(ax, means, tuple(present), f"{name}\n({', '.join(present)})")
        for ax in axes.flat[len(families) :]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.suptitle(f"RULER score vs budget per task family — {_subtitle(ruler)}", fontsize=11)
        fig.tight_layout()
        # Below the panels (after the layout, so it cannot cover the x-axis labels); the saved
        # figure's tight bounding box takes it in.
        fig.legend(
            handles,
            labels,
            loc="upper center",
            ncol=min(len(labels), 3 * cols),
            fontsize=8,
            bbox_to_anchor=(0.5, 0.0),
        )
        paths += _save(fig, out, f"{prefix}ruler_accuracy_by_family")
    return paths


def niah_heatmap(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    niah = df[(df["benchmark"] == "niah") & df["ok"] & df["depth"].notna()]
    if niah.empty:
        return []
    niah = niah.assign(
        who=niah.apply(
            lambda r: r["label"] if r["method"] == "full" else f"{r['label']} @ {r['budget']:.0%}", axis=1
        )
    )
    order = niah.sort_values(["method_rank", "budget"]).drop_duplicates("who")["who"].tolist()
    depths = sorted(niah["depth"].unique())
    lengths = sorted(niah["length"].unique())
    cols = min(4, len(order))
    rows = (len(order) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 1, 2.8 * rows + 0.6), squeeze=False, layout="constrained"
    )
    image = None
    for index, (ax, who) in enumerate(zip(axes.flat, order, strict=False)):
        grid = niah[niah["who"] == who].pivot_table(
            index="depth", columns="length", values="score", aggfunc="mean"
        )
        grid = grid.reindex(index=depths, columns=lengths)
        image = ax.imshow(grid.values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
        ax.set_title(who, fontsize=10)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{int(x) // 1024}k" if x >= 1024 else str(int(x)) for x in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{d:g}%" for d in depths], fontsize=8)
        ax.set_xlabel("Context length (tokens)", fontsize=8)
        if index % cols == 0:
            ax.set_ylabel("Needle depth (% of context)", fontsize=8)
        for (i, j), value in np.ndenumerate(grid.values):
            if not np.isnan(value):
                color = "white" if value < 25 or value > 80 else "black"  # readable on dark cells
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8, color=color)
    for ax in axes.flat[len(order) :]:
        ax.axis("off")
    fig.suptitle(
        f"Needle in a haystack: retrieval score (0-100) — {', '.join(sorted(niah['model'].unique()))}",
        fontsize=11,
    )
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="Score (0-100)")
    return _save(fig, out, f"{prefix}niah_heatmap")


def speed_vs_context(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    timed = df[df["ok"] & df["tpot"].notna()]
    if timed.empty or timed["length"].nunique() < 2:
        return []
    timed = timed.assign(
        who=timed.apply(
            lambda r: r["label"] if r["method"] == "full" else f"{r['label']} @ {r['budget']:.0%}", axis=1
        ),
        tpot_ms=timed["tpot"] * 1000,
        kv_mib=timed["kv_bytes_final"].fillna(timed["kv_bytes"]) / 2**20,
    )
    agg = timed.groupby(["method", "method_rank", "who", "length"], as_index=False)[
        ["tpot_ms", "kv_mib"]
    ].mean()
    agg = agg.sort_values(["method_rank", "who", "length"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (method, rank, who), group in agg.groupby(["method", "method_rank", "who"], sort=False):
        group = group.sort_values("length")
        style = dict(linestyle="--", color="black", marker="o") if method == "full" else _style(rank)
        ax1.plot(group["length"], group["tpot_ms"], label=who, **style)
        ax2.plot(group["length"], group["kv_mib"], label=who, **style)
    for ax, ylabel, title in (
        (ax1, "Time per output token (ms)", "Decoding speed"),
        (ax2, "KV cache size after decoding (MiB)", "KV cache memory"),
    ):
        ax.set_xscale("log", base=2)
        lengths = sorted(agg["length"].unique())
        ax.set_xticks(lengths)
        ax.set_xticklabels([f"{int(x) // 1024}k" if x >= 1024 else str(int(x)) for x in lengths])
        ax.set_xlabel("Context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left")
    device = ", ".join(sorted(timed["model"].unique()))
    fig.suptitle(f"TPOT and KV memory vs context length — {device}", fontsize=11)
    fig.tight_layout()
    return _save(fig, out, f"{prefix}speed_vs_context")


def score_vs_r(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    ours = df[(df["method"] == "centroidkv") & df["ok"] & (df["benchmark"] == "ruler")]
    if ours.empty or ours["params_json"].nunique() < 2:
        return []
    ours = ours.assign(
        r_init=ours["params"].map(lambda p: p.get("r_init")),
        schedule=ours["params"].map(lambda p: f"{p.get('r_init')}/{p.get('delta_r')}/{p.get('r_min')}"),
    )
    means = ours.groupby(["schedule", "r_init", "budget", "task"], as_index=False)["score"].mean()
    avg = means.groupby(["schedule", "r_init", "budget"], as_index=False)["score"].mean()
    varies_only_r = avg.groupby("r_init")["schedule"].nunique().max() == 1
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    schedules = sorted(avg["schedule"].unique(), key=lambda s: [float(x) for x in s.split("/")])
    for i, budget in enumerate(sorted(avg["budget"].unique())):
        part = avg[avg["budget"] == budget]
        if varies_only_r:
            part = part.sort_values("r_init")
            ax.plot(part["r_init"], part["score"], marker="o", color=f"C{i}", label=f"budget {budget:.0%}")
        else:
            xs = [schedules.index(s) for s in part["schedule"]]
            ax.plot(xs, part["score"], marker="o", linestyle="", color=f"C{i}", label=f"budget {budget:.0%}")
    full = df[
        (df["method"] == "full")
        & df["ok"]
        & (df["benchmark"] == "ruler")
        & df["task"].isin(ours["task"].unique())
    ]
    if not full.empty:
        ax.axhline(
            full.groupby("task")["score"].mean().mean(), color="black", linestyle="--", label="Full cache"
        )
    if varies_only_r:
        ax.set_xlabel("r_init: fraction of set-A tokens merged per round")
    else:
        ax.set_xticks(range(len(schedules)))
        ax.set_xticklabels(schedules, rotation=30, fontsize=8)
        ax.set_xlabel("r schedule (r_init / delta_r / r_min)")
    ax.set_ylabel("RULER average score (0-100)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"CentroidKV: score vs r schedule — {_subtitle(ours)}", fontsize=10)
    return _save(fig, out, f"{prefix}score_vs_r")


FIGURES = (accuracy_vs_budget, niah_heatmap, speed_vs_context, score_vs_r)


def make_figures(df: pd.DataFrame, out: Path) -> list[Path]:
    """Every figure the records allow, per experiment."""
    paths: list[Path] = []
    for experiment, part in df.groupby("experiment"):
        for figure in FIGURES:
            paths += figure(part, out, f"{experiment}_")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="results folders or records.jsonl files")
    parser.add_argument("--out", type=Path, default=ROOT / "paper_figures")
    args = parser.parse_args(argv)
    df = load_or_error(args.paths)
    if isinstance(df, str):
        print(df, file=sys.stderr)
        return 2
    paths = make_figures(df, args.out)
    for path in paths:
        print(f"[figure] {path}")
    if not paths:
        print("no figure could be drawn from these records", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
