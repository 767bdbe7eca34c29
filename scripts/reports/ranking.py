"""How far a set of records resolves its methods' order: the paired bootstrap over samples behind every
table's ranking, bold top tier and "resolved" words (`scripts/tables.py`, `scripts/head_attribution.py`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

RESOLVED = 0.9  # a lead with P below this is "level": bold, rank tiers and words follow it
# Fewer samples per method than this resolve no comparison, whatever the bootstrap says: with one
# sample every draw is the same sample, and P(> next) only says whether two scores are equal.
MIN_SAMPLES = 10


def count_words(count: int, noun: str) -> str:
    """`1 task`, `2 tasks`: a count with its noun in the right number."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def resolved_words(p: float, n_samples: int) -> str:
    """Whether a lead with P(a > b) = `p` on `n_samples` paired samples is resolved, in words: "yes" when
    P (either way) reaches RESOLVED on at least MIN_SAMPLES samples, else what stops it."""
    words = [] if max(p, 1 - p) >= RESOLVED else [f"level (P {p:.2f})"]
    if n_samples < MIN_SAMPLES:
        words.append(f"too few samples ({n_samples} < {MIN_SAMPLES})")
    return "; ".join(words) or "yes"


def unresolved_words(n_samples: int) -> str:
    """The words a table carries when `n_samples` per method cannot resolve its comparisons ("" when
    they can): tables and rankings say it, not only their numbers."""
    if n_samples >= MIN_SAMPLES:
        return ""
    return (
        f"only {count_words(n_samples, 'sample')} per method (fewer than {MIN_SAMPLES}): "
        "the differences between these rows are not resolved"
    )


def at_budget(df: pd.DataFrame, budget: float) -> pd.DataFrame:
    """The finished records at `budget`, with the full cache's (it has no budget)."""
    return df[df["ok"] & ((df["budget"] == budget) | (df["method"] == "full"))]


def sample_groups(df: pd.DataFrame, budget: float) -> list[list[str]]:
    """The labels at `budget` grouped for paired comparisons when some methods ran on fewer samples
    (a method entry's `samples` cap): for each distinct sample count, largest first, the labels that
    finished at least that many samples. One group (every label) when all ran on the same samples."""
    counts = at_budget(df, budget).groupby("label")["sample_id"].size()
    return [
        [label for label in counts.index if counts[label] >= n] for n in sorted(set(counts), reverse=True)
    ]


def bootstrap(
    df: pd.DataFrame, budget: float, draws: int = 2000, seed: int = 0, labels: list[str] | None = None
):
    """The paired bootstrap of `ranking_table` at `budget` over `labels` (default: every label):
    (labels, means [methods], per_draw [draws, methods], within_tasks, samples), or None when no
    sample was finished by every one of them."""
    rng = np.random.default_rng(seed)
    part = at_budget(df, budget)
    if labels is not None:
        part = part[part["label"].isin(labels)]
    scores = part.pivot_table(index=["task", "sample_id"], columns="label", values="score", aggfunc="mean")
    scores = scores.dropna()
    if scores.empty:
        return None
    tasks = scores.index.get_level_values("task")
    within_tasks = tasks.value_counts().min() >= 2
    groups = (
        [scores[tasks == task].to_numpy() for task in tasks.unique()] if within_tasks else [scores.to_numpy()]
    )
    per_draw = np.zeros((draws, scores.shape[1]))
    for matrix in groups:  # [samples, methods], resampled by row
        picks = rng.integers(0, len(matrix), size=(draws, len(matrix)))
        per_draw += matrix[picks].mean(axis=1)
    per_draw /= len(groups)
    means = scores.groupby(level="task").mean().mean(axis=0).to_numpy()
    return list(scores.columns), means, per_draw, within_tasks, len(scores)


def p_above(per_draw: np.ndarray, a: int, b: int) -> float:
    """The fraction of draws in which column `a` scores above column `b` (ties count half)."""
    diff = per_draw[:, a] - per_draw[:, b]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


def ranking_table(df: pd.DataFrame, budgets: list[float], draws: int = 2000, seed: int = 0) -> pd.DataFrame:
    """How stable the ranking by average score is, per budget: a paired bootstrap over samples.

    Each draw resamples, within every task, that task's samples with replacement (the same samples
    for every method: they share prompts), and recomputes each method's average over tasks. Reported
    per method: the average, its 95 % interval, and P(> next), the fraction of draws in which it
    scores above the method ranked just below it (ties count half). P(> next) >= 0.95 means that
    step of the ranking would survive new samples; near 0.5 means the two are not told apart.
    `Rank` is a tier: methods joined by steps with P(> next) < RESOLVED (0.9) share one ("1-2"), so
    the order inside a tier is not claimed. The "resolved" column says in words what the sample
    cannot resolve: "level with <next>" for a step with P < RESOLVED, "too few samples" under
    MIN_SAMPLES (10) samples per method (whatever P says: with one sample every draw is alike), else
    "yes"; the caption warns when a budget has too few samples. Only samples every ranked method
    finished are used: when some methods ran on fewer samples (a `samples` cap), the methods that
    ran on the most are ranked first on all of theirs, then every method on the samples all share
    (`sample_groups`; the `samples` column tells the rankings apart). A task with a single sample has
    nothing to resample within it (every draw would be equal, claiming a certainty the data do not
    have), so when some task has fewer than 2 samples the draws resample the samples across tasks
    instead, and the "bootstrap" column says so.
    """
    rows = []
    for budget in budgets:
        for labels in sample_groups(df, budget):
            found = bootstrap(df, budget, draws, seed, labels)
            if found is not None:
                rows += _ranked_rows(budget, found)
    table = pd.DataFrame(rows)
    return table.set_index("Budget") if not table.empty else table


def _ranked_rows(budget: float, found: tuple) -> list[dict]:
    """One budget's ranking rows from its bootstrap (`bootstrap`'s tuple; see `ranking_table`)."""
    labels, means, per_draw, within_tasks, n_samples = found
    order = np.argsort(-means, kind="stable")
    beats = [p_above(per_draw, a, b) for a, b in zip(order[:-1], order[1:], strict=True)] + [None]
    tiers, start = [], 0  # [first, last] rank of each position's tier
    for position in range(len(order)):
        if beats[position] is None or beats[position] >= RESOLVED:
            tiers += [(start + 1, position + 1)] * (position + 1 - start)
            start = position + 1
    rows = []
    for position, column in enumerate(order):
        low, high = np.percentile(per_draw[:, column], [2.5, 97.5])
        first, last = tiers[position]
        words = []
        if beats[position] is not None and beats[position] < RESOLVED:
            words.append(f"level with {labels[order[position + 1]]} (P {beats[position]:.2f} < {RESOLVED:g})")
        if n_samples < MIN_SAMPLES:
            words.append(f"too few samples ({n_samples} < {MIN_SAMPLES})")
        elif beats[position] is not None and not words:
            words.append("yes")
        rows.append(
            {
                "Budget": f"{budget:g}",
                "Rank": f"{first}" if first == last else f"{first}-{last}",
                "Method": labels[column],
                "Avg": means[column],
                "95% CI": f"{low:.1f}-{high:.1f}",
                "P(> next)": "-" if beats[position] is None else f"{beats[position]:.2f}",
                "resolved": "; ".join(words) or "-",
                "samples": n_samples,
                "bootstrap": "within tasks" if within_tasks else "across tasks",
            }
        )
    return rows


def top_tier(df: pd.DataFrame, budget: float) -> set[str]:
    """The compressing methods level with the best of them at `budget` (P(best > m) < RESOLVED): the
    rows whose average is bolded. Among the methods that ran on the most samples (`sample_groups`):
    a capped method's few samples cannot place it. Empty when the records cannot be bootstrapped."""
    found = bootstrap(df, budget, labels=sample_groups(df, budget)[0])
    if found is None:
        return set()
    labels, means, per_draw, _, _ = found
    compressing = [i for i, label in enumerate(labels) if not str(label).startswith("Full")]
    if not compressing:
        return set()
    best = max(compressing, key=lambda i: means[i])
    return {labels[i] for i in compressing if i == best or p_above(per_draw, best, i) < RESOLVED}
