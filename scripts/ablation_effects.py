"""Main effects of CentroidKV's ablation (make ablate-centroidkv): mean RULER score per level of each factor.

Reads the records of a results folder (`results/ablate_centroidkv`) or of a compact records file
(`results/ablate_centroidkv.jsonl.gz`, the committed ones), whose CentroidKV variants are named `<similarity>-<outliers>-c<chunk>-<schedule>`
(configs/experiment/ablate_centroidkv.yaml). For every factor and budget it averages the score over
the variants at each level (in the half fraction every level of one factor is seen with balanced
levels of the others, except chunk, aliased with similarity x outliers), with a 95 % bootstrap
interval over samples (resampling samples keeps each sample's variants together). Prints a Markdown
table and draws `paper_figures/ablation_effects.png`.

    python scripts/ablation_effects.py [results/ablate_centroidkv]
    python scripts/ablation_effects.py results/ablate_centroidkv.jsonl.gz
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.compact_store import SUFFIX, CompactError, read_compact  # noqa: E402
from eval.job_store import iter_records  # noqa: E402

FACTORS = ("similarity", "outliers", "chunk", "schedule")
BOOTSTRAP_DRAWS = 2000

Scores = dict[str, dict[tuple[str, float], float]]  # sample id -> (entry, budget) -> score


class Effect(NamedTuple):
    factor: str
    level: str
    budget: float
    mean: float
    low: float  # the 95 % bootstrap interval over samples
    high: float


def load(path: Path) -> list[dict]:
    """The successful records of a results folder or a compact file; SystemExit with one line when
    there are none."""
    try:
        if path.is_file() and path.name.endswith(SUFFIX):
            found = read_compact(path)[1]
        elif path.is_dir():
            found = list(iter_records([path]))
        else:
            raise CompactError(f"no results folder or compact records file {path}")
    except CompactError as error:
        raise SystemExit(f"ablation_effects.py: error: {error}") from None
    records = [record for record in found if record.get("status") == "ok"]
    if not records:
        raise SystemExit(f"ablation_effects.py: error: no successful records in {path}")
    return records


def factor_levels(variant: str) -> dict[str, str] | None:
    """A design variant's level of each factor ("pre-out-c256-adapt"), None for another entry."""
    parts = variant.split("-")
    if len(parts) != 4 or not parts[2].startswith("c"):
        return None
    return dict(zip(FACTORS, parts, strict=True))


def entry_of(record: dict) -> str:
    return record.get("variant") or record["method"]


def scores_of(records: list[dict]) -> Scores:
    scores: Scores = defaultdict(dict)
    for record in records:
        scores[record["sample_id"]][(entry_of(record), record["budget"])] = record["score"]
    return scores


def design(scores: Scores) -> tuple[list[str], list[float], list[str]]:
    """The design's variants and budgets, and the samples every (variant, budget) has run on (a
    running job has a partial last sample)."""
    variants = sorted({v for per in scores.values() for v, _ in per if factor_levels(v)})
    budgets = sorted({b for per in scores.values() for v, b in per if factor_levels(v)})
    samples = sorted(s for s, per in scores.items() if all((v, b) in per for v in variants for b in budgets))
    if not variants or not samples:
        raise SystemExit("ablation_effects.py: error: no sample has every design variant at every budget")
    return variants, budgets, samples


def main_effects(scores: Scores, seed: int = 0) -> list[Effect]:
    """Per factor, level and budget: the mean over samples of the mean over the level's variants."""
    variants, budgets, samples = design(scores)
    draws = np.random.default_rng(seed).integers(0, len(samples), size=(BOOTSTRAP_DRAWS, len(samples)))
    effects = []
    for factor in FACTORS:
        for level in sorted({factor_levels(v)[factor] for v in variants}):
            members = [v for v in variants if factor_levels(v)[factor] == level]
            for budget in budgets:
                per_sample = np.array([np.mean([scores[s][(v, budget)] for v in members]) for s in samples])
                low, high = np.percentile(per_sample[draws].mean(axis=1), [2.5, 97.5])
                effects.append(
                    Effect(factor, level, budget, float(per_sample.mean()), float(low), float(high))
                )
    return effects


def ranking_table(records: list[dict], scores: Scores) -> list[str]:
    """Markdown rows: every entry's mean score (and KV ratio) per budget, best first; the full
    cache, run at budget 1 only, is shown at every budget."""
    _, budgets, samples = design(scores)
    ratios: dict[tuple[str, float], list[float]] = defaultdict(list)
    for record in records:
        if record["sample_id"] in samples and record.get("kv_ratio") is not None:
            ratios[(entry_of(record), record["budget"])].append(record["kv_ratio"])
    rows = []
    for entry in sorted({v for s in samples for v, _ in scores[s]}):
        ran = {b for s in samples for v, b in scores[s] if v == entry}
        at = [b if b in ran else 1.0 for b in budgets]  # the full cache: budget 1 only
        means = [
            float(np.mean([scores[s][(entry, b)] for s in samples if (entry, b) in scores[s]])) for b in at
        ]
        kv = [float(np.mean(ratios[(entry, b)])) if ratios[(entry, b)] else 1.0 for b in at]
        rows.append((float(np.mean(means)), entry, means, kv))
    lines = [
        "| configuration | " + " | ".join(f"score {b} (KV ratio)" for b in budgets) + " | mean |",
        "|---|" + "---|" * (len(budgets) + 1),
    ]
    for mean, entry, means, kv in sorted(rows, reverse=True):
        cells = [f"{m:.1f} ({k:.3f})" for m, k in zip(means, kv, strict=True)]
        lines.append(f"| {entry} | " + " | ".join(cells) + f" | {mean:.1f} |")
    return lines


def effects_table(effects: list[Effect]) -> list[str]:
    budgets = sorted({e.budget for e in effects})
    lines = [
        "| factor | level | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|---|---|" + "---|" * len(budgets),
    ]
    for factor in FACTORS:
        for level in sorted({e.level for e in effects if e.factor == factor}):
            cells = [f"{e.mean:.1f} [{e.low:.1f}, {e.high:.1f}]" for e in effects if e[:2] == (factor, level)]
            lines.append(f"| {factor} | {level} | " + " | ".join(cells) + " |")
    return lines


def plot_effects(effects: list[Effect], n_samples: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FACTORS), figsize=(3.2 * len(FACTORS), 3.2), sharey=True)
    budgets = sorted({e.budget for e in effects})
    for ax, factor in zip(axes, FACTORS, strict=True):
        levels = sorted({e.level for e in effects if e.factor == factor})
        for offset, budget in zip((-0.1, 0.1), budgets, strict=False):
            picked = [next(e for e in effects if e[:3] == (factor, lv, budget)) for lv in levels]
            means = np.array([e.mean for e in picked])
            errors = np.array([[e.mean - e.low for e in picked], [e.high - e.mean for e in picked]])
            ax.errorbar(np.arange(len(levels)) + offset, means, yerr=errors, fmt="o-", capsize=3,
                        label=f"budget {budget}")  # fmt: skip
        ax.set_xticks(range(len(levels)), levels)
        ax.set_title(factor)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RULER score (mean over variants at the level)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"CentroidKV ablation main effects ({n_samples} samples, 95 % bootstrap intervals)", fontsize=10
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    records = load(Path(args[0] if args else "results/ablate_centroidkv"))
    scores = scores_of(records)
    variants, _, samples = design(scores)
    effects = main_effects(scores)
    print(f"{len(samples)} samples, {len(variants)} variants\n")
    print("\n".join(ranking_table(records, scores)), end="\n\n")
    print("\n".join(effects_table(effects)))
    out = Path("paper_figures") / "ablation_effects.png"
    plot_effects(effects, len(samples), out)
    print(f"\nfigure: {out}")


if __name__ == "__main__":
    main()
