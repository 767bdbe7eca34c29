"""The paper's figures from any set of results, as PNG + PDF next to the results they draw.

  python scripts/figures.py results/<experiment>              # -> results/<experiment>/figures/
  python scripts/figures.py results/*/ --out paper_figures    # every figure in one folder (make targets)

Figures (each drawn when the records hold what it needs), named <experiment>_<figure>, per benchmark
the records name (their `benchmark` field) as its report asks (`eval.benchmarks.Report`; no benchmark
is named here):
  <benchmark>_accuracy_vs_budget  average score vs budget per method (full cache dashed);
  <benchmark>_accuracy_by_family  the same per task family (when the report has families and the
                            records hold two of them or more);
  <benchmark>_score_vs_kv   average score vs the measured KV ratio (tables.kv_ratio), one line per
                            method or variant, one point per budget: the Pareto view;
  <benchmark>_heatmap       score by needle depth x context length, one panel per method@budget (when
                            the report asks for it);
  speed_vs_context          TPOT and KV cache size vs context length per method;
  <benchmark>_score_vs_param  average score vs the parameter(s) a method was swept over (r_init,
                            schedule, chunk_size, ...), one panel per swept method, one line per budget.

A method's colour and marker are the same in every figure (`scripts/reports/figure_styles.py`); equal points
stay visible (lines dodged sideways, equal coordinates spread along x; each figure says which); titles
name the benchmark by its report; files are written atomically, never through a symbolic link.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from centroidkv.files import replaced_atomically  # noqa: E402
from centroidkv.methods import method_label  # noqa: E402
from centroidkv.parsing import is_number  # noqa: E402
from eval.benchmarks import Report, benchmark_report  # noqa: E402
from eval.records import RECORDS, differing_keys  # noqa: E402
from scripts.reports.captions import head_policies, samples_per_cell  # noqa: E402
from scripts.reports.figure_styles import (  # noqa: E402
    FULL_MARKER,
    PRECISION_MARKERS,
    label_precision,
    label_styles,
    method_style,
    series_look,
    series_styles,
    spread_coinciding,
)
from scripts.reports.table_files import OutputError, output_folder, output_path, safe_name  # noqa: E402
from scripts.reports.tables import ABSENT, format_value, kv_ratio, load_or_error, short_key_names  # noqa: E402


def _note(ax, text: str, y: float) -> None:
    """A small grey line of explanation under the axes (at `y`, in axes coordinates)."""
    ax.text(
        0.5, y, text, transform=ax.transAxes, ha="center", va="top", fontsize=7, color="dimgray", wrap=True
    )


def benchmark_title(benchmark: str) -> str:
    """The benchmark's name in every figure title: its report's (`Report.title`, e.g. "RULER")."""
    return benchmark_report(benchmark).title


def _save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    """Save `fig` as PNG and PDF, each to a temporary file in `out` renamed into place; `name` is made
    of `safe_name`s, and each path is checked to lie directly in `out` (`output_path`)."""
    try:
        output_folder(out)
        paths = [output_path(out, f"{name}.png"), output_path(out, f"{name}.pdf")]
        for path in paths:
            with replaced_atomically(path) as temporary:
                fig.savefig(temporary, format=path.suffix[1:], dpi=150, bbox_inches="tight")
    except OSError as error:
        raise OutputError(f"error: cannot write {out / name}: {error.strerror or error}") from None
    finally:
        plt.close(fig)
    return paths


def _task_means(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score and measured KV ratio per (label, budget, task) over successful samples; a label is
    one method or variant."""
    ok = df[df["ok"]].assign(kv=lambda part: kv_ratio(part))
    keys = ["method", "label_rank", "label", "budget", "task"]
    return ok.groupby(keys, as_index=False).agg(score=("score", "mean"), kv=("kv", "mean"))


def _averages(means: pd.DataFrame) -> pd.DataFrame:
    """Per (label, budget): the average over tasks of the per-task means, and the mean KV ratio; only
    points that have every task of `means` (an average over fewer tasks would not compare)."""
    n_tasks = means["task"].nunique()
    avg = (
        means.groupby(["method", "label_rank", "label", "budget"])
        .agg(score=("score", "mean"), kv=("kv", "mean"), n=("task", "nunique"))
        .reset_index()
    )
    return avg[avg["n"] == n_tasks].sort_values(["label_rank", "budget"])


def _subtitle(df: pd.DataFrame) -> str:
    models = ", ".join(sorted(df["model"].dropna().unique()))
    lengths = ", ".join(
        f"{int(x) // 1024}k" if x >= 1024 else str(int(x)) for x in sorted(df["length"].dropna().unique())
    )
    policies = textwrap.fill(head_policies(df), width=80, break_on_hyphens=False)  # the figure's width
    return f"{models}, context {lengths} tokens, {samples_per_cell(df)}\n{policies}"


def _accuracy_axes(
    ax, means: pd.DataFrame, tasks: tuple[str, ...] | None, title: str, styles: dict[str, dict]
) -> bool:
    part = means if tasks is None else means[means["task"].isin(tasks)]
    if part.empty:
        return False
    avg = _averages(part)
    budgets = sorted(avg.loc[avg["method"] != "full", "budget"].unique())
    n_lines = avg.loc[avg["method"] != "full", "label"].nunique()
    spread = 0.08 * (max(budgets) - min(budgets) if len(budgets) > 1 else 0.25)
    line = 0
    for (method, _, label), rows in avg.groupby(["method", "label_rank", "label"], sort=False):
        if method == "full":
            style = {k: v for k, v in styles[label].items() if k != "marker"}
            ax.axhline(rows["score"].mean(), label=f"{label} (no compression)", zorder=5, **style)
            continue
        # Dodge: equal scores would hide each other, so each line is shifted a little sideways.
        offset = (line - (n_lines - 1) / 2) * spread / max(1, n_lines - 1)
        ax.plot(
            rows["budget"] + offset, rows["score"], label=label, linewidth=1.6, markersize=6, **styles[label]
        )
        line += 1
    ax.set_title(title, fontsize=11)
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:.0%}" for b in budgets])
    if len(budgets) == 1:  # one budget: centre it, with room for the dodged points on either side
        ax.set_xlim(budgets[0] - 2 * spread, budgets[0] + 2 * spread)
    ax.set_xlabel("KV cache budget (fraction of prompt + generation)")
    ax.set_ylabel("Score (0-100)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    return True


def accuracy_vs_budget(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    """Per benchmark: the average score vs budget, and per task family when its report has families."""
    paths = []
    for benchmark, part in df.groupby("benchmark"):
        if part.loc[part["method"] != "full", "budget"].nunique() < 1:
            continue
        report = benchmark_report(benchmark)
        means = _task_means(part)
        styles = label_styles(part)
        fig, ax = plt.subplots(figsize=(7, 4.6))
        tasks = ", ".join(sorted(part["task"].unique()))
        title = f"{benchmark_title(benchmark)}: average score vs KV budget\n{_subtitle(part)}"
        _accuracy_axes(ax, means, None, title, styles)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), title="Method")
        _note(
            ax, f"tasks: {tasks}; methods are offset slightly along x so that equal scores stay visible", -0.2
        )
        paths += _save(fig, out, f"{prefix}{safe_name(benchmark)}_accuracy_vs_budget")
        paths += _accuracy_by_family(part, means, report, styles, out, f"{prefix}{safe_name(benchmark)}")
    return paths


def _accuracy_by_family(
    part: pd.DataFrame, means: pd.DataFrame, report: Report, styles: dict[str, dict], out: Path, name: str
) -> list[Path]:
    """One benchmark's score vs budget, one panel per task family of its report that the records hold
    (none when they hold fewer than two)."""
    families = [
        (family, tasks) for family, tasks in report.families.items() if part["task"].isin(tasks).any()
    ]
    if len(families) < 2:
        return []
    cols = min(3, len(families))
    rows = (len(families) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False, sharey=True)
    for ax, (family, tasks) in zip(axes.flat, families, strict=False):
        present = [t for t in tasks if t in set(part["task"])]
        _accuracy_axes(ax, means, tuple(present), f"{family}\n({', '.join(present)})", styles)
    for ax in axes.flat[len(families) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(f"{report.title}: score vs KV budget per task family\n{_subtitle(part)}", fontsize=11)
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
    return _save(fig, out, f"{name}_accuracy_by_family")


def heatmaps(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    """Per benchmark whose report asks for it: the score by needle depth x context length."""
    if "depth" not in df:
        return []
    paths = []
    for benchmark, part in df[df["ok"] & df["depth"].notna()].groupby("benchmark"):
        report = benchmark_report(benchmark)
        if report.heatmap:
            paths += _heatmap(part, report, out, f"{prefix}{safe_name(benchmark)}_heatmap")
    return paths


def _heatmap(scored: pd.DataFrame, report: Report, out: Path, name: str) -> list[Path]:
    """One panel per method@budget: mean score per (depth, length) cell."""
    scored = scored.assign(
        who=scored.apply(
            lambda r: r["label"] if r["method"] == "full" else f"{r['label']} @ {r['budget']:.0%}", axis=1
        )
    )
    order = scored.sort_values(["label_rank", "budget"]).drop_duplicates("who")["who"].tolist()
    depths = sorted(scored["depth"].unique())
    lengths = sorted(scored["length"].unique())
    cols = min(4, len(order))
    rows = (len(order) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 1, 2.8 * rows + 0.6), squeeze=False, layout="constrained"
    )
    image = None
    for index, (ax, who) in enumerate(zip(axes.flat, order, strict=False)):
        grid = scored[scored["who"] == who].pivot_table(
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
        f"{report.title}: retrieval score (0-100) by needle depth and context length\n"
        f"{', '.join(sorted(scored['model'].unique()))}; {head_policies(scored)}",
        fontsize=11,
    )
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="Score (0-100)")
    return _save(fig, out, name)


def speed_vs_context(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    if "tpot" not in df:
        return []
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
    agg = timed.groupby(["method", "label_rank", "budget", "who", "length"], as_index=False)[
        ["tpot_ms", "kv_mib"]
    ].mean()
    agg = agg.sort_values(["label_rank", "budget", "length"])
    firsts = timed.sort_values(["label_rank", "budget"]).drop_duplicates("who")
    styles = series_styles(list(zip(firsts["who"], firsts["method"], firsts["params"], strict=True)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for who, group in agg.groupby("who", sort=False):
        group = group.sort_values("length")
        ax1.plot(group["length"], group["tpot_ms"], label=who, **styles[who])
        ax2.plot(group["length"], group["kv_mib"], label=who, **styles[who])
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
    fig.suptitle(f"Decoding speed and KV memory vs context length\n{device}", fontsize=11)
    fig.tight_layout()
    return _save(fig, out, f"{prefix}speed_vs_context")


SPREAD = 0.016  # x distance between points that would coincide in the score vs KV figure


def score_vs_kv(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    """Per benchmark: the average score against the measured KV ratio (the Pareto view).

    One line per method or variant through its budgets, each point the average over tasks of the
    per-task means (only points that have every task) at the mean measured KV ratio
    (`tables.kv_ratio`: what the cache held at the end of the decode); the full cache is a dashed reference line through its own star,
    one legend entry for both. Points that would hide each other (equal ratio and score) are spread
    SPREAD apart along x around their true ratio (`spread_coinciding`), and the figure says so.
    When runs store their entries at several precisions (labels "CentroidKV @int8", `precision_suffix`),
    the marker is the precision (`PRECISION_MARKERS`), so entries x bits make one Pareto picture.
    """
    paths = []
    for benchmark, part in df[df["ok"]].groupby("benchmark"):
        avg = _averages(_task_means(part)).dropna(subset=["kv"])
        if avg.loc[avg["method"] != "full"].empty:
            continue
        styles = label_styles(part)
        series = [
            (label, rows.sort_values("kv"))
            for (_, _, label), rows in avg.groupby(["method", "label_rank", "label"], sort=False)
        ]
        offsets = spread_coinciding(
            [(label, x, y) for label, rows in series for x, y in zip(rows["kv"], rows["score"], strict=True)],
            SPREAD,
        )
        spread = any(offsets.values())
        fig, ax = plt.subplots(figsize=(7, 4.6))
        precisions_shown = avg["label"].map(label_precision).nunique() > 1
        for label, rows in series:
            style = styles[label]
            x = rows["kv"] + [offsets[label, i] for i in range(len(rows))]
            if style["marker"] == FULL_MARKER:
                line = {k: v for k, v in style.items() if k != "marker"}
                ax.axhline(rows["score"].mean(), zorder=5, **line)  # in the legend with its star
                ax.plot(x, rows["score"], markersize=11, label=f"{label} (no compression)", **style)
                continue
            if precisions_shown:  # the method's colour, the precision's marker
                style = {**style, "marker": PRECISION_MARKERS[label_precision(label)]}
            ax.plot(x, rows["score"], label=label, linewidth=1.4, markersize=6, **style)
        ax.set_xlabel("Measured KV ratio (bytes stored after compression / full cache of n + max new tokens)")
        ax.set_ylabel("Average score (0-100)")
        ax.set_xlim(left=0)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), title="Method")
        marker_note = " (marker: storage precision)" if precisions_shown else ""
        ax.set_title(
            f"{benchmark_title(benchmark)}: average score vs measured KV ratio{marker_note}\n{_subtitle(part)}",
            fontsize=10,
        )
        if spread:
            _note(
                ax,
                f"points at equal ratio and score are spread {SPREAD:g} apart along x around their true ratio",
                -0.16,
            )
        paths += _save(fig, out, f"{prefix}{safe_name(benchmark)}_score_vs_kv")
    return paths


def _param_axis(ax, labels: list[str], keys: list[str], names: dict, identity_of: dict) -> tuple[dict, bool]:
    """Each label's x position on `ax` and whether the axis is numeric: the parameter's value when a
    single numeric parameter varies, else one categorical tick per configuration (named by its values,
    or by its own label in a design over more than two factors)."""
    values = {label: [identity_of[label].get(k, ABSENT) for k in keys] for label in labels}
    if len(keys) == 1 and all(is_number(v[0]) for v in values.values()):
        return {label: float(v[0]) for label, v in values.items()}, True
    if len(keys) > 2:  # a design over many factors: its configurations' own names are readable
        ticks = labels
    else:
        ticks = [
            ", ".join(f"{names[k]}={format_value(v)}" for k, v in zip(keys, values[label], strict=True))
            for label in labels
        ]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(ticks, rotation=30, ha="right", fontsize=8)
    return {label: float(i) for i, label in enumerate(labels)}, False


def score_vs_param(df: pd.DataFrame, out: Path, prefix: str) -> list[Path]:
    """Per benchmark: each method's average score against the parameter(s) it was swept over.

    A method is swept when its labels (tables.load: one per configuration) differ in their identity
    (`row_identity`: parameters, or job-wide keys such as max_new_tokens). One panel per swept method,
    one line per budget. The x axis is the parameter's value when a single numeric parameter varies;
    otherwise it is categorical, each tick naming the combination (`r_init=0.3, schedule=linear`).
    """
    paths = []
    for benchmark, part in df[df["ok"]].groupby("benchmark"):
        avg = _averages(_task_means(part))
        identity_of = dict(zip(part["label"], part["identity"], strict=False))
        panels = []
        for method, rows in avg[avg["method"] != "full"].groupby("method", sort=False):
            labels = list(dict.fromkeys(rows["label"]))
            keys = differing_keys([identity_of[label] for label in labels])
            if len(labels) > 1 and keys:
                panels.append((method, rows, labels, keys))
        if not panels:
            continue
        title = f"{benchmark_title(benchmark)}: score vs swept parameters\n{_subtitle(part)}"
        height = 4.4 + 0.25 * (title.count("\n") - 1)  # room for the title's lines (the head policies wrap)
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), height), squeeze=False)
        full = avg[avg["method"] == "full"].groupby("label", sort=False)["score"].mean()
        styles = label_styles(part)
        params_of = dict(zip(part["method"], part["params"], strict=False))
        for ax, (method, rows, labels, keys) in zip(axes.flat, panels, strict=True):
            names = short_key_names(keys)
            x_of, numeric = _param_axis(ax, labels, keys, names, identity_of)
            for i, (budget, series) in enumerate(rows.groupby("budget")):  # the method's colour, by budget
                series = series.assign(x=series["label"].map(x_of)).sort_values("x")
                style = {**method_style(method, params_of.get(method)), **series_look(i)}
                if not numeric:  # categorical: the line only joins the configurations
                    style["linestyle"] = ":"
                ax.plot(series["x"], series["score"], label=f"budget {budget:g}", **style)
            for label, score in full.items():
                line = {k: v for k, v in styles[label].items() if k != "marker"}
                ax.axhline(score, label=f"{label} (no compression)", **line)
            ax.set_xlabel(textwrap.fill("varies: " + ", ".join(names[k] for k in keys), 70), fontsize=8)
            ax.set_ylabel("Average score (0-100)")
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            swept = ", ".join(names[k] for k in keys) if len(keys) <= 2 else "configuration"
            ax.set_title(f"{method_label(method)}: score vs {swept}", fontsize=10)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        paths += _save(fig, out, f"{prefix}{safe_name(benchmark)}_score_vs_param")
    return paths


FIGURES = (accuracy_vs_budget, score_vs_kv, heatmaps, speed_vs_context, score_vs_param)


def make_figures(df: pd.DataFrame, out: Path | Mapping[str, Path]) -> list[Path]:
    """Every figure the records allow, per experiment, into `out`: one folder, or one per experiment
    (experiment -> folder, `figure_folders`)."""
    paths: list[Path] = []
    for experiment, part in df.groupby("experiment"):
        folder = out if isinstance(out, Path) else out[experiment]
        for figure in FIGURES:
            paths += figure(part, folder, f"{safe_name(experiment)}_")
    return paths


def figure_folders(paths: list[Path], experiments: list[str]) -> dict[str, Path]:
    """experiment -> where its figures go without --out: next to the results they draw,
    `<results>/<experiment>/figures/`. An experiment's folder is the one above the job folders whose
    records.jsonl the paths hold, found by its name (the first found when two paths hold one name);
    records naming an experiment no folder has (copied from elsewhere) go to the figures folder of
    the first path (of its folder, for a file)."""
    found: dict[str, Path] = {}
    for path in paths:
        files = [path] if path.is_file() else sorted(path.rglob(RECORDS))
        for file in files:
            found.setdefault(file.parent.parent.name, file.parent.parent)
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    return {experiment: found.get(experiment, first) / "figures" for experiment in experiments}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="results folders or records.jsonl files")
    help_out = "one folder for every figure (default: <results>/<experiment>/figures/ for each experiment)"
    parser.add_argument("--out", type=Path, help=help_out)
    args = parser.parse_args(argv)
    df = load_or_error(args.paths)
    if isinstance(df, str):
        print(df, file=sys.stderr)
        return 2
    out = args.out or figure_folders(args.paths, sorted(df["experiment"].unique()))
    try:
        paths = make_figures(df, out)
    except OutputError as error:
        print(error, file=sys.stderr)
        return 2
    for path in paths:
        print(f"[figure] {path}")
    if not paths:
        print("no figure could be drawn from these records", file=sys.stderr)
    return 0
