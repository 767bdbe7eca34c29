"""A method entry's `samples` runs it on the first samples of each task and length only, inside the
same job (so those samples share their prefill with every other method); a cap is part of the job's
identity, and a job without caps keeps the identity it had. A bad cap is one line."""

from __future__ import annotations

from collections import Counter

import pytest

from eval.config import CONFIG_DIR, build_run_config, store_configs
from eval.records import read_records
from eval.runner import config_yaml_of, run_job


def _compose(tmp_path, methods: str):
    from hydra import compose, initialize_config_dir

    store_configs()
    overrides = ["model=tiny-llama", "benchmark=toy", "benchmark.n_samples=3", "benchmark.lengths=[256,512]",
                 "logger=none", "warmup=false", "budgets=[0.5]", f"methods={methods}",
                 f"results_dir={tmp_path / 'results'}"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _counts(cfg) -> Counter:
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert all(r["status"] == "ok" for r in records)
    return Counter((r["variant"], r["length"]) for r in records)


def test_a_capped_method_runs_on_the_first_samples_and_a_changed_cap_is_another_job(tmp_path):
    capped = _compose(tmp_path, "[full,{name:snapkv,samples:1},{name:streaming_llm,samples:{512:2}}]")
    cfg = build_run_config(capped, "job")
    run_job(cfg, config_yaml_of(cfg, capped))
    tasks = len(cfg.benchmark.tasks)
    assert _counts(cfg) == Counter({
        ("full", 256): 3 * tasks, ("full", 512): 3 * tasks,
        ("snapkv", 256): tasks, ("snapkv", 512): tasks,
        ("streaming_llm", 256): 3 * tasks, ("streaming_llm", 512): 2 * tasks,
    })  # fmt: skip
    raised = _compose(tmp_path, "[full,{name:snapkv,samples:2},{name:streaming_llm,samples:{512:2}}]")
    with pytest.raises(Exception, match="snapkv.samples"):  # another job's folder: refused, not mixed
        run_job(build_run_config(raised, "job"), config_yaml_of(cfg, raised))


def test_a_job_without_caps_keeps_its_identity(tmp_path):
    cfg = build_run_config(_compose(tmp_path, "[full,snapkv]"), "job")
    assert not any(key.endswith(".samples") for key in cfg.identity())


@pytest.mark.parametrize("cap", ["0", "-1", "x", "true", "{512:0}", "{x:2}"])
def test_a_bad_cap_is_one_line(tmp_path, cap):
    with pytest.raises(ValueError, match=r"methods: samples of snapkv: a count >= 1") as error:
        build_run_config(_compose(tmp_path, f"[full,{{name:snapkv,samples:{cap}}}]"), "job")
    assert "\n" not in str(error.value).strip()


def test_the_ranking_keeps_every_sample_of_the_uncapped_methods():
    """With one method capped at 2 samples, the methods run on all 12 are ranked on their 12 (their
    lead resolved) and then every method on the 2 all share; bold goes by the 12."""
    import pandas as pd

    from scripts.reports.ranking import ranking_table, top_tier

    scores = {"a": [100.0] * 12, "b": [100.0, 0.0] * 6, "capped": [100.0, 100.0]}
    df = pd.DataFrame(
        [
            {"task": f"t{i % 2}", "sample_id": f"s{i}", "label": label, "method": label, "budget": 0.5,
             "ok": True, "score": score}
            for label, values in scores.items()
            for i, score in enumerate(values)
        ]
    )  # fmt: skip
    table = ranking_table(df, [0.5])
    main = table[table["samples"] == 12]
    assert list(main["Method"]) == ["a", "b"] and main["resolved"].iloc[0] == "yes"
    shared = table[table["samples"] == 2]
    assert set(shared["Method"]) == {"a", "b", "capped"}
    assert top_tier(df, 0.5) == {"a"}
