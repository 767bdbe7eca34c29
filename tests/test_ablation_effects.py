"""scripts/ablation_effects.py: main effects of the ablation's half fraction, from synthetic scores."""

from __future__ import annotations

import itertools

import pytest

from scripts import ablation_effects as effects

VARIANTS = [
    f"{sim}-{out}-c{chunk}-{schedule}"
    for (sim, out, chunk), schedule in itertools.product(
        [("pre", "out", 256), ("post", "out", 64), ("pre", "none", 64), ("post", "none", 256)],
        ["const", "adapt"],
    )
]


def records(n_samples: int = 4) -> list[dict]:
    """Outlier heads decide the score (100 with, 0 without), except one variant that misses one sample;
    the full cache runs at budget 1 only and scores 50."""
    found = []
    for sample in range(n_samples):
        for variant, budget in itertools.product(VARIANTS, [0.25, 0.5]):
            score = 100.0 if "-out-" in variant else 0.0
            if variant == "pre-out-c256-const" and sample == 0:
                score = 0.0
            found.append({"sample_id": f"s{sample}", "variant": variant, "method": "centroidkv",
                          "budget": budget, "score": score, "kv_ratio": budget, "status": "ok"})  # fmt: skip
        found.append(
            {"sample_id": f"s{sample}", "method": "full", "budget": 1.0, "score": 50.0, "status": "ok"}
        )
    return found


def test_main_effects_average_the_variants_of_each_level():
    found = effects.main_effects(effects.scores_of(records()))
    by_level = {(e.factor, e.level, e.budget): e for e in found}
    assert by_level["outliers", "none", 0.25].mean == 0.0
    # 4 "out" variants on 4 samples, one of the 16 scores 0: sample 0's level mean is 75
    assert by_level["outliers", "out", 0.25].mean == pytest.approx((75 + 100 * 3) / 4)
    assert by_level["outliers", "out", 0.25].low < by_level["outliers", "out", 0.25].high <= 100
    assert by_level["schedule", "adapt", 0.5].mean == 50.0  # 2 out of 4 variants score 100
    assert {e.factor for e in found} == set(effects.FACTORS)


def test_ranking_shows_the_full_cache_at_every_budget_and_orders_by_mean():
    found = records()
    lines = effects.ranking_table(found, effects.scores_of(found))
    names = [line.split(" | ")[0][2:] for line in lines[2:]]
    assert set(names[:3]) == {"pre-out-c256-adapt", "post-out-c64-const", "post-out-c64-adapt"}
    assert names[3] == "pre-out-c256-const"  # 0 on one of its 4 samples: 75.0
    assert lines[5] == "| pre-out-c256-const | 75.0 (0.250) | 75.0 (0.500) | 75.0 |"
    full = next(line for line in lines if line.startswith("| full |"))
    assert full == "| full | 50.0 (1.000) | 50.0 (1.000) | 50.0 |"


def test_only_samples_with_every_variant_count():
    found = [r for r in records() if not (r["sample_id"] == "s3" and r.get("variant") == VARIANTS[0])]
    assert effects.design(effects.scores_of(found))[2] == ["s0", "s1", "s2"]


def test_bad_input_gives_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no results folder or compact records file"):
        effects.load(tmp_path / "missing")
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_text("not gzip")
    with pytest.raises(SystemExit, match="not a gzipped text file"):
        effects.load(bad)
