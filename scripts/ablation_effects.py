"""Main effects of CentroidKV's ablation (make ablate): mean RULER score per level of each factor.

Reads `results/ablate_centroidkv/*/records.jsonl`, whose CentroidKV variants are named
`<similarity>-<outliers>-c<chunk>-<schedule>` (configs/experiment/ablate_centroidkv.yaml). For every
factor and budget it averages the score over the variants at each level (in the half fraction every
level of one factor is seen with balanced levels of the others, except chunk, aliased with
similarity x outliers), with a 95 % bootstrap interval over samples (resampling samples keeps each
sample's variants together). Prints a Markdown table and draws `paper_figures/ablation_effects.png`.

    python scripts/ablation_effects.py [results/ablate_centroidkv]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

FACTORS = ("similarity", "outliers", "chunk", "schedule")


def load(folder: Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("*/records.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("status") == "ok":
                records.append(record)
    if not records:
        raise SystemExit(f"no records under {folder}/*/records.jsonl")
    return records


def factor_levels(variant: str) -> dict[str, str] | None:
    parts = variant.split("-")
    if len(parts) != 4 or not parts[2].startswith("c"):
        return None
    return dict(zip(FACTORS, parts, strict=True))


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/ablate_centroidkv")
    records = load(folder)
    # score[sample][(variant, budget)]
    scores: dict[str, dict[tuple[str, float], float]] = defaultdict(dict)
    for record in records:
        scores[record["sample_id"]][(record.get("variant") or record["method"], record["budget"])] = record[
            "score"
        ]
    variants = sorted({v for per in scores.values() for v, _ in per if factor_levels(v)})
    budgets = sorted({b for per in scores.values() for v, b in per if factor_levels(v)})
    # only samples every (variant, budget) has run on (a running job has a partial last sample)
    samples = sorted(s for s, per in scores.items() if all((v, b) in per for v in variants for b in budgets))
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(samples), size=(2000, len(samples)))
    rows = []
    for factor in FACTORS:
        for level in sorted({factor_levels(v)[factor] for v in variants}):
            members = [v for v in variants if factor_levels(v)[factor] == level]
            for budget in budgets:
                per_sample = np.array(
                    [
                        np.mean([scores[s][(v, budget)] for v in members if (v, budget) in scores[s]])
                        for s in samples
                    ]
                )
                boot = per_sample[draws].mean(axis=1)
                rows.append((factor, level, budget, per_sample.mean(), *np.percentile(boot, [2.5, 97.5])))
    print(f"{len(samples)} samples, {len(variants)} variants\n")
    ratio: dict[tuple[str, float], list[float]] = defaultdict(list)
    for record in records:
        if record["sample_id"] in samples and record.get("kv_ratio") is not None:
            ratio[(record.get("variant") or record["method"], record["budget"])].append(record["kv_ratio"])
    entries = sorted({v for s in samples for v, _ in scores[s]})
    table = []
    for entry in entries:
        means = [
            np.mean([scores[s][(entry, b)] for s in samples]) if (entry, b) in scores[samples[0]] else None
            for b in budgets
        ]
        if means[0] is None:  # the full cache runs at budget 1 only
            means = [np.mean([scores[s][(entry, 1.0)] for s in samples])] * len(budgets)
        kv = [np.mean(ratio[(entry, b)]) if ratio[(entry, b)] else 1.0 for b in budgets]
        table.append((float(np.mean(means)), entry, means, kv))
    print("| configuration | " + " | ".join(f"score {b} (KV ratio)" for b in budgets) + " | mean |")
    print("|---|" + "---|" * (len(budgets) + 1))
    for mean, entry, means, kv in sorted(table, reverse=True):
        cells = [f"{m:.1f} ({k:.3f})" for m, k in zip(means, kv, strict=True)]
        print(f"| {entry} | " + " | ".join(cells) + f" | {mean:.1f} |")
    print()
    print("| factor | level | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for factor in FACTORS:
        for level in sorted({r[1] for r in rows if r[0] == factor}):
            cells = [
                f"{m:.1f} [{lo:.1f}, {hi:.1f}]" for f, lv, b, m, lo, hi in rows if f == factor and lv == level
            ]
            print(f"| {factor} | {level} | " + " | ".join(cells) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FACTORS), figsize=(3.2 * len(FACTORS), 3.2), sharey=True)
    for ax, factor in zip(axes, FACTORS, strict=True):
        levels = sorted({r[1] for r in rows if r[0] == factor})
        for offset, budget in zip((-0.1, 0.1), budgets, strict=False):
            picked = [
                next(r for r in rows if r[0] == factor and r[1] == lv and r[2] == budget) for lv in levels
            ]
            means = np.array([p[3] for p in picked])
            errors = np.array([[p[3] - p[4] for p in picked], [p[5] - p[3] for p in picked]])
            ax.errorbar(
                np.arange(len(levels)) + offset,
                means,
                yerr=errors,
                fmt="o-",
                capsize=3,
                label=f"budget {budget}",
            )
        ax.set_xticks(range(len(levels)), levels)
        ax.set_title(factor)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RULER score (mean over variants at the level)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"CentroidKV ablation main effects ({len(samples)} samples, 95 % bootstrap intervals)", fontsize=10
    )
    fig.tight_layout()
    out = Path("paper_figures") / "ablation_effects.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"\nfigure: {out}")


if __name__ == "__main__":
    main()
