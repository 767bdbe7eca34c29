"""scripts/head_attribution.py: what a head policy adds, and what clustering adds, from hand-made records."""

import pandas as pd

from scripts.head_attribution import attribution


def records(scores: dict[tuple[str, str], list[float]]) -> pd.DataFrame:
    rows = []
    for (method, policy), values in scores.items():
        for index, score in enumerate(values):
            rows.append(
                {
                    "method": method,
                    "params": {"heads": policy, "heads_file": "needle"},
                    "label": f"{method}-{policy}",
                    "budget": 0.25,
                    "ok": True,
                    "score": score,
                    "task": f"task{index % 2}",
                    "sample_id": f"s{index}",
                }
            )
    return pd.DataFrame(rows)


def test_heads_and_clustering_are_attributed_with_their_p():
    df = records(
        {
            ("centroidkv", "none"): [100, 100, 100, 100, 0, 100] * 2,
            ("centroidkv", "whole"): [100, 100, 100, 100, 100, 100] * 2,
            ("snapkv", "none"): [0, 0, 0, 0, 0, 0] * 2,
            ("snapkv", "whole"): [100, 0, 100, 0, 100, 0] * 2,
        }
    )
    tables = attribution(df, None)
    heads = tables["0.25 heads"]
    assert heads.loc["snapkv", "best"] == "whole" and heads.loc["snapkv", "heads add"] == 50.0
    assert float(heads.loc["snapkv", "P(best > none)"]) > 0.9
    clustering = tables["0.25 clustering"]
    row = clustering.loc["snapkv (whole)"]
    assert row["clustering adds"] == 50.0 and row["resolved"] == "yes"
    # the same lead on half the samples: P alone would call it, the sample count does not
    first_half = df[df["sample_id"].isin([f"s{index}" for index in range(6)])]
    clustering = attribution(first_half, None)["0.25 clustering"]
    assert clustering.loc["snapkv (whole)", "resolved"] == "too few samples (6 < 10)"
    # chosen on other records (as on dev), a policy that is worse here is still the one reported
    chooser = records(
        {
            ("centroidkv", "none"): [100],
            ("centroidkv", "whole"): [0],
            ("snapkv", "none"): [100],
            ("snapkv", "whole"): [0],
        }
    )
    heads = attribution(df, chooser)["0.25 heads"]
    assert heads.loc["centroidkv", "best"] == "none" and heads.loc["snapkv", "heads add"] == 0.0


def test_a_capped_method_does_not_cut_the_others_to_its_samples():
    """A method entry run on its first 2 samples (`samples: 2`) is compared on those 2; the methods
    run on all 12 keep their 12 (and resolve) instead of being cut to the 2 the job shares."""
    df = records(
        {
            ("centroidkv", "none"): [0] * 12,
            ("centroidkv", "whole"): [100] * 12,
            ("snapkv", "none"): [100, 0] * 6,
            ("snapkv", "whole"): [100, 0] * 6,
            ("h2o", "none"): [0, 0],
            ("h2o", "whole"): [100, 100],
        }
    )
    clustering = attribution(df, None)["0.25 clustering"]
    assert clustering.loc["snapkv (none)", "samples"] == 12
    assert clustering.loc["snapkv (none)", "resolved"] == "yes"
    assert clustering.loc["h2o (whole)", "samples"] == 2
    heads = attribution(df, None)["0.25 heads"]
    assert heads.loc["centroidkv", "samples"] == 12 and heads.loc["h2o", "samples"] == 2
