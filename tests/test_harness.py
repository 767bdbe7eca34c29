"""The harness: config validation, resumption, failure isolation, multirun, W&B offline, tables, figures.

Everything runs on `tiny-llama` with the self-contained `toy` benchmark (a few hundred tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eval.config import CONFIG_DIR, build_run_config, store_configs
from eval.job_store import JobStore
from eval.records import read_records, record_key
from eval.run_config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "records"
TINY = ["model=tiny-llama", "benchmark=toy", "logger=none", "warmup=false"]


def composed(overrides: list[str]):
    store_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_cfg(tmp_path: Path, overrides: list[str], job: str = "job"):
    cfg = composed([*TINY, f"results_dir={tmp_path}", *overrides])
    return build_run_config(cfg, job), cfg


def config_error_line(tmp_path: Path, overrides: list[str]) -> str:
    """The line a bad config is refused with, asserting that there is exactly one."""
    with pytest.raises(ConfigError) as error:
        run_cfg(tmp_path, overrides)
    assert len(error.value.lines) == 1, error.value.lines
    return error.value.lines[0]


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "override, fragment",
    [
        ("method.budget=1.5", "budget must be a fraction in (0, 1]"),
        ("method.budget=0", "budget must be a fraction in (0, 1]"),
        ("method.params.r_init=2.0", "r_init"),
        ("method.params.chunk_size=3", "chunk_size"),
        ("+method.params.bogus=1", "unknown parameter"),
        ("methods=[full,nope]", "unknown method 'nope'"),
        ("benchmark.n_samples=0", "benchmark.n_samples"),
        ("benchmark.lengths=[-5]", "benchmark.lengths"),
        ("model.name=gpt-5", "unknown model"),
        ("model.dtype=float8", "model.dtype"),
        ("logger.name=slack", "logger.name"),
        ("benchmark.context_only=maybe", "benchmark.context_only"),
    ],
)
def test_each_bad_value_gives_one_line(tmp_path, override, fragment):
    assert fragment in config_error_line(tmp_path, [override])


def test_a_length_over_the_models_positions_is_one_line(tmp_path):
    overrides = ["model=qwen2.5-0.5b", "benchmark=ruler", "benchmark.lengths=[16384,40000]"]
    line = config_error_line(tmp_path, overrides)
    assert "40000 tokens" in line and "32768 positions" in line


def test_ruler_task_names_are_checked(tmp_path):
    with pytest.raises(ConfigError) as error:
        build_run_config(
            composed(["benchmark=ruler", "benchmark.tasks=[niah_single_1,niah_single_9]"]), "job"
        )
    assert error.value.lines == [error.value.lines[0]] and "niah_single_9" in error.value.lines[0]


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_validates(experiment):
    cfg = build_run_config(composed([f"experiment={experiment}"]), "job")
    assert cfg.experiment == experiment and cfg.methods
    if experiment.startswith("reproduce"):
        assert {m.name for m in cfg.methods} >= {"full", "centroidkv", "streaming_llm", "h2o", "snapkv", "pyramidkv",
                                                 "kmeans", "cam"}  # fmt: skip
    if experiment == "reproduce_ruler_cpu":  # the paper's table: each method as its paper defines it, once
        assert "duo_attention" in {m.name for m in cfg.methods}
        assert 0.125 in {m.budget for m in cfg.methods}


def test_method_configs_come_from_the_registry():
    from centroidkv import get_method, method_names

    assert not (CONFIG_DIR / "method").exists()  # no YAML copy of any default
    for name in method_names():
        cfg = composed([f"method={name}"])
        assert cfg.method.name == name and cfg.method.params == get_method(name).params()


def test_a_method_registered_later_needs_no_config_file(tmp_path):
    """A method defined after startup (as baselines/ discovery or an entry point would) is usable as
    `method=<name>` and inside `methods=[...]` with nothing else written."""
    from dataclasses import dataclass

    import torch

    from centroidkv.methods import REGISTRY, Method, register
    from eval.runner import config_yaml_of, run_job

    @dataclass
    class KeepFirst(Method):
        """Keeps the first `target_len` tokens of the mergeable segment (a test method)."""

        name = "keep_first_test"
        offset: int = 0

        def compress(self, kv, target_len, stats):
            index = torch.arange(self.offset, self.offset + target_len, device=kv.keys.device)
            return kv.select(index.expand(*kv.keys.shape[:2], -1))

    register(KeepFirst)
    try:
        cfg, _ = run_cfg(tmp_path, ["method=keep_first_test", "method.params.offset=3"])
        assert [(s.name, s.params["offset"]) for s in cfg.methods] == [("keep_first_test", 3)]
        cfg, raw = run_cfg(
            tmp_path, ["methods=[full,keep_first_test]", "budgets=[0.5]", "benchmark.n_samples=1"]
        )
        assert [s.label for s in cfg.methods] == ["full@1", "keep_first_test@0.5"]
        assert cfg.methods[1].params == KeepFirst().params()
        run_job(cfg, config_yaml_of(cfg, raw))
        records, _ = read_records(cfg.job_dir / "records.jsonl")
        assert [(r["method"], r["status"]) for r in records] == [("full", "ok"), ("keep_first_test", "ok")]
        assert records[1]["kv_bytes"] < records[0]["kv_bytes"]
    finally:
        del REGISTRY["keep_first_test"]


def test_two_bad_values_give_two_lines(tmp_path):
    with pytest.raises(ConfigError) as error:
        run_cfg(tmp_path, ["method.budget=2", "benchmark.n_samples=-1"])
    assert len(error.value.lines) == 2


def test_methods_times_budgets_share_one_job(tmp_path):
    cfg, _ = run_cfg(tmp_path, ["methods=[full,centroidkv,snapkv]", "budgets=[0.25,0.5]"])
    labels = [spec.label for spec in cfg.methods]
    assert labels == ["full@1", "centroidkv@0.25", "centroidkv@0.5", "snapkv@0.25", "snapkv@0.5"]
    assert cfg.job_dir == tmp_path.resolve() / "default" / "job"


VARIANTS = "methods=[full,centroidkv,{name:centroidkv,variant:centroidkv_r02,params:{r_init:0.2,r_min:0.05}}]"


def test_method_variants_set_each_entry_s_parameters(tmp_path):
    cfg, _ = run_cfg(tmp_path, [VARIANTS, "budgets=[0.25,0.5]", "method.params.chunk_size=64"])
    assert [spec.label for spec in cfg.methods] == [
        "full@1", "centroidkv@0.25", "centroidkv@0.5", "centroidkv_r02@0.25", "centroidkv_r02@0.5"
    ]  # fmt: skip
    by_variant = {spec.variant: spec for spec in cfg.methods}
    assert by_variant["centroidkv_r02"].name == "centroidkv"
    # defaults, then method.params (method.name is centroidkv), then the entry's own params
    assert (
        by_variant["centroidkv"].params["r_init"] == 0.5
        and by_variant["centroidkv"].params["chunk_size"] == 64
    )
    assert by_variant["centroidkv_r02"].params == {
        **by_variant["centroidkv"].params,
        "r_init": 0.2,
        "r_min": 0.05,
    }


@pytest.mark.parametrize(
    "methods, fragment",
    [
        ("methods=[centroidkv,{name:centroidkv,params:{r_init:0.2}}]", "'centroidkv' appears twice"),
        ("methods=[{name:centroidkv,variant:a,params:{r_init:7}}]", "method a (centroidkv): r_init"),
        ("methods=[{name:centroidkv,variant:a,param:{r_init:0.2}}]", "unknown key(s) param"),
        ("methods=[{name:nope,variant:a}]", "unknown method 'nope'"),
        ("methods=[{name:centroidkv,variant:'a b'}]", "variant must be a plain name"),
    ],
)
def test_bad_method_variant_gives_one_line(tmp_path, methods, fragment):
    assert fragment in config_error_line(tmp_path, [methods])


def test_method_variants_share_the_prefill_and_resume_by_variant(tmp_path):
    from eval.runner import config_yaml_of, run_job

    cfg, raw = run_cfg(tmp_path, [VARIANTS, "budgets=[0.5]", "benchmark.n_samples=2"])
    run_job(cfg, config_yaml_of(cfg, raw))
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert len(records) == 2 * 3 and all(r["status"] == "ok" for r in records)
    assert {(r["method"], r["variant"], r["params"]["r_init"]) for r in records if r["method"] != "full"} == {
        ("centroidkv", "centroidkv", 0.5),
        ("centroidkv", "centroidkv_r02", 0.2),
    }
    first = [r for r in records if r["sample_id"] == records[0]["sample_id"]]
    assert len({r["prefill_s"] for r in first}) == 1  # one prefill for the three variants
    assert len({record_key(r) for r in records}) == 6
    # Resuming finds every (sample, variant) done: dropping done.json reruns nothing.
    (cfg.job_dir / "done.json").unlink()
    run_job(cfg, config_yaml_of(cfg, raw))
    assert len(cfg.job_dir.joinpath("records.jsonl").read_text().splitlines()) == 6


def test_records_without_a_variant_keep_their_key():
    old = {"benchmark": "toy", "task": "t", "sample_id": "0", "method": "snapkv", "params": {}, "budget": 0.5}
    assert record_key(old) == record_key({**old, "variant": "snapkv"}) != record_key({**old, "variant": "x"})


def test_job_records_and_skip_when_finished(tmp_path):
    from eval.runner import config_yaml_of, run_job

    # decode_batch=1: every fork decoded alone, so each record has its own TPOT and peak memory
    overrides = ["methods=[full,centroidkv]", "budgets=[0.5]", "benchmark.n_samples=2", "decode_batch=1"]
    cfg, raw = run_cfg(tmp_path, overrides)
    summary = run_job(cfg, config_yaml_of(cfg, raw))
    records, dirty = read_records(cfg.job_dir / "records.jsonl")
    assert not dirty and len(records) == 4 and summary["n_records"] == 4
    for record in records:
        assert record["status"] == "ok" and record["decode_batch"] == 1
        for field in ("task", "sample_id", "method", "params", "budget", "prediction", "references", "score", "ttft",
                      "tpot", "kv_bytes", "peak_mem", "context_length"):  # fmt: skip
            assert record.get(field) is not None, field
    by_method = {r["method"]: r for r in records if r["sample_id"] == records[0]["sample_id"]}
    assert by_method["centroidkv"]["kv_bytes"] < by_method["full"]["kv_bytes"]
    assert by_method["centroidkv"]["prefill_s"] == by_method["full"]["prefill_s"]  # one shared prefill
    env = json.loads((cfg.job_dir / "env.json").read_text())
    assert env["device"] == "cpu" and env["versions"]["torch"]
    assert "validated" in (cfg.job_dir / "config.yaml").read_text()
    assert run_job(cfg, config_yaml_of(cfg, raw)) is None  # finished: skipped
    assert len(read_records(cfg.job_dir / "records.jsonl")[0]) == 4


def test_failed_sample_is_recorded_and_job_goes_on(tmp_path, monkeypatch):
    import eval.evaluate
    import eval.runner as runner

    real = eval.evaluate.sample_prompt

    def flaky(sample, *args):
        if sample["index"] == 1:
            raise RuntimeError("bad data in sample 1")
        return real(sample, *args)

    monkeypatch.setattr(eval.evaluate, "sample_prompt", flaky)
    # centroidkv at 0.001 keeps no entry of a ~300-token prompt: fails at compression (a budget short
    # of its 81 protected tokens only shrinks them: tests/test_short_prompts.py).
    cfg, raw = run_cfg(
        tmp_path, ["methods=[full,centroidkv]", "budgets=[0.001,0.5]", "benchmark.n_samples=3"]
    )
    summary = runner.run_job(cfg, runner.config_yaml_of(cfg, raw))
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert len(records) == 9 and summary["n_failed"] == 3 + 2
    failed = [r for r in records if r["status"] == "failed"]
    assert {r["sample_id"] for r in failed if "bad data" in r["error"]} == {"toy-256-1"}
    budget_failures = [r for r in failed if r["sample_id"] != "toy-256-1"]
    assert {r["budget"] for r in budget_failures} == {0.001} and all(
        "no room for any token" in r["error"] for r in budget_failures
    )
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) == 4 and {r["sample_id"] for r in ok} == {"toy-256-0", "toy-256-2"}
    # the protected windows kept: centroidkv's own (16, 64) at 0.5, none for the full cache
    assert {(r["method"], r["n_sink_used"], r["n_recent_used"]) for r in ok} == {
        ("full", None, None),
        ("centroidkv", 16, 64),
    }
    assert JobStore(cfg.job_dir).finished


def test_context_only_feeds_the_question_uncompressed(tmp_path, monkeypatch):
    """The context is compressed, then the question is appended to the cache as it is: one entry of
    degree 1 per token, and (layer 0, whose keys depend on the token and position only) the same keys
    as in a full-cache run of the whole prompt. compress_interval=1 would re-compress at the first
    token over the budget if the feed were not paused; max_new_tokens=1 leaves the cache as the feed
    made it."""
    import torch

    import centroidkv.plan.plan
    import centroidkv.plan.prefill_store
    from centroidkv.cache.cache import CompressedCache
    from centroidkv.plan.decoding import prefill
    from eval.runner import config_yaml_of, run_job

    seen: dict[str, list] = {"prefill": [], "question": [], "fork": []}
    real_prefill, real_start, real_fork = (
        centroidkv.plan.plan.prefill,
        centroidkv.plan.plan.start_fork,
        CompressedCache.fork,
    )

    def spy_prefill(model, input_ids, *args, **kwargs):
        seen["prefill"].append((model, input_ids))
        return real_prefill(model, input_ids, *args, **kwargs)

    def spy_start(model, prefilled, method, budget, max_new_tokens, question_ids=None, *args, **kwargs):
        seen["question"].append(question_ids)
        return real_start(model, prefilled, method, budget, max_new_tokens, question_ids, *args, **kwargs)

    def spy_fork(self, *args, **kwargs):
        twin = real_fork(self, *args, **kwargs)
        seen["fork"].append((twin, twin.seq_lengths()))
        return twin

    monkeypatch.setattr(centroidkv.plan.plan, "prefill", spy_prefill)
    monkeypatch.setattr(centroidkv.plan.prefill_store, "prefill", spy_prefill)  # the natives' prefill
    monkeypatch.setattr(centroidkv.plan.plan, "start_fork", spy_start)
    monkeypatch.setattr(CompressedCache, "fork", spy_fork)
    overrides = ["method.budget=0.5", "method.params.compress_interval=1", "benchmark.n_samples=1",
                 "benchmark.context_only=true", "benchmark.max_new_tokens=1"]  # fmt: skip
    cfg, raw = run_cfg(tmp_path, overrides)
    run_job(cfg, config_yaml_of(cfg, raw))
    (record,) = read_records(cfg.job_dir / "records.jsonl")[0]
    assert record["status"] == "ok" and record["protocol"] == "context_only" and record["n_generated"] == 1
    ((model, context_ids),), (question_ids,), ((cache, compressed),) = (
        seen["prefill"],
        seen["question"],
        seen["fork"],
    )
    n_context, n_question = context_ids.shape[1], question_ids.shape[1]
    assert n_question > 0 and record["context_length"] == n_context + n_question
    full = prefill(model, torch.cat([context_ids, question_ids], dim=1), 1).cache
    for layer, n_compressed in zip(cache.layers, compressed, strict=True):
        assert n_compressed < n_context and layer.main.length == n_compressed + n_question
        degrees = layer.main.log_degree
        assert (degrees[..., :n_compressed] > 0).any()  # the context was merged ...
        assert (degrees[..., n_compressed:] == 0).all()  # ... the question was not: degree 1 each
    question_keys = cache.layers[0].keys[:, :, -n_question:]
    torch.testing.assert_close(question_keys, full.layers[0].keys[:, :, n_context:])


def test_torn_and_duplicate_lines_are_cleaned(tmp_path):
    store = JobStore(tmp_path / "job")
    store.dir.mkdir(parents=True)
    a = {
        "benchmark": "toy",
        "task": "t",
        "sample_id": "0",
        "method": "full",
        "params": {},
        "budget": 1.0,
        "status": "ok",  # a line without the fields of a record is dropped as a bad line
        "score": 1,
    }
    b = {**a, "sample_id": "1"}
    store.append(a)
    store.append(b)
    store.append({**a, "score": 2})  # a rerun of the same key: the last one wins
    with store.records_path.open("a") as handle:
        handle.write('{"benchmark": "toy", "task": "t", "sample_')  # killed mid-write
    records = store.load()
    assert sorted((r["sample_id"], r["score"]) for r in records) == [("0", 2), ("1", 1)]
    assert (
        store.records_path.read_text().endswith("}\n")
        and len(store.records_path.read_text().splitlines()) == 2
    )


def test_wandb_offline_run_has_the_job_metrics(tmp_path, monkeypatch):
    from eval.runner import config_yaml_of, run_job

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = build_run_config(
        composed(
            [
                "model=tiny-llama",
                "benchmark=toy",
                "logger=wandb",
                "warmup=false",
                f"results_dir={tmp_path}",
                "benchmark.n_samples=1",
                "method.budget=0.5",
            ]
        ),  # fmt: skip
        "wandb_job",
    )
    summary = run_job(cfg, config_yaml_of(cfg, None))
    runs = list((cfg.job_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))
    # wandb 0.31 keeps an offline run's history and summary in its binary run file (synced later by
    # `wandb sync`); the per-sample table is a JSON file next to it.
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in summary:
        assert key.encode() in data, key
    assert b"toy/centroidkv@0.5/score" in data  # per-record history
    table = json.loads(next((runs[0] / "files" / "media" / "table").glob("samples_*.table.json")).read_text())
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    column = {name: i for i, name in enumerate(table["columns"])}
    assert [row[column["sample_id"]] for row in table["data"]] == [r["sample_id"] for r in records]
    assert [row[column["score"]] for row in table["data"]] == [r["score"] for r in records]
    assert [row[column["variant"]] for row in table["data"]] == [r["variant"] for r in records]


# ------------------------------------------------------------------------------------------ outputs
def test_tables_from_fixture(tmp_path):
    from scripts.reports.tables import main

    assert main([str(FIXTURES / "fixture_ruler"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "ruler_budget0.25.md").read_text()
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md.splitlines()[3:]
    }
    # Hand-computed from the fixture: columns S-NIAH-1, VT, Avg, KV (no measured ratio: -; the full
    # cache is 1.00 of its own reference), n, failed.
    assert rows["Full cache"] == ["100.0", "100.0", "100.0", "1.00", "4", "0"]
    # Only Avg is bolded, for every compressing method level with the best (P < 0.9 by the paired
    # bootstrap): 50.0 vs 37.5 on 4 samples is not resolved, so both are.
    assert rows["CentroidKV"] == ["50.0", "50.0", "**50.0**", "-", "4", "0"]
    assert rows["SnapKV"] == ["0.0", "75.0", "**37.5**", "-", "4", "0"]
    md50 = (tmp_path / "ruler_budget0.5.md").read_text()
    assert "| SnapKV | 50.0 | 0.0 | 25.0 | - | 4 | 1 |" in md50  # the failed sample is counted, not averaged
    tex = (tmp_path / "ruler_budget0.5.tex").read_text()
    assert r"\begin{tabular}" in tex and r"CentroidKV & 100.0 & 50.0 & \textbf{75.0}" in tex


def test_ranking_table_from_fixture(tmp_path):
    from scripts.reports.tables import main

    assert main([str(FIXTURES / "fixture_ruler"), "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "ruler_ranking.md").read_text().splitlines()[4:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| 0.25")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("1", "Full cache", "100.0"),
        ("2-3", "CentroidKV", "50.0"),  # P 0.72 < 0.9: one tier, the order inside it not claimed
        ("2-3", "SnapKV", "37.5"),
    ]
    assert rows[0][4] == "100.0-100.0" and rows[0][5] == "1.00"  # CentroidKV can reach 75 at most
    # CentroidKV vs SnapKV, paired draws of 2 samples per task, enumerated by hand: P(>) + P(=)/2 = 0.72
    assert abs(float(rows[1][5]) - 0.72) < 0.04
    assert rows[2][5] == "-"


def test_ranking_with_one_sample_per_task_resamples_across_tasks():
    """One sample per task leaves nothing to resample within a task: the draws resample across
    tasks, so intervals have width and a method that loses one task is not certainly ahead."""
    import pandas as pd

    from scripts.reports.ranking import ranking_table

    scores = {"a": (100.0, 100.0, 0.0), "b": (100.0, 0.0, 100.0), "c": (100.0, 100.0, 0.0)}
    df = pd.DataFrame(
        [
            {"task": task, "sample_id": f"{task}-0", "label": label, "method": method, "budget": 0.5,
             "ok": True, "score": score}
            for task, row in scores.items()
            for (label, method), score in zip((("Full cache", "full"), ("X", "x"), ("Y", "y")), row)
        ]
    )  # fmt: skip
    table = ranking_table(df, [0.5])
    assert list(table["Method"]) == ["Full cache", "X", "Y"]
    assert set(table["bootstrap"]) == {"across tasks"}
    low, high = (float(v) for v in table["95% CI"].iloc[1].split("-"))
    assert low == 0.0 and high == 100.0  # X's three draws can be all 0 or all 100
    assert 0.5 < float(table["P(> next)"].iloc[1]) < 0.95  # X > Y on 2 of 3 tasks: not certain


def test_speed_table_from_fixture(tmp_path):
    from scripts.reports.tables import main

    assert main([str(FIXTURES / "fixture_speed"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "speed.md").read_text()
    assert "| Full cache | 30.00 | 36.00 | 50.00 |" in md
    assert "| CentroidKV @ 0.25 | 28.00 | 29.00 | 30.00 |" in md


def test_figures_from_fixture(tmp_path):
    from scripts.reports.figures import main

    assert main([str(FIXTURES), "--out", str(tmp_path)]) == 0
    expected = [
        "fixture_ruler_ruler_accuracy_vs_budget",
        "fixture_ruler_ruler_accuracy_by_family",
        "fixture_speed_niah_heatmap",
        "fixture_speed_speed_vs_context",
        "fixture_sweep_r_ruler_score_vs_param",
    ]
    for name in expected:
        for suffix in (".png", ".pdf"):
            path = tmp_path / f"{name}{suffix}"
            assert path.exists() and path.stat().st_size > 5000, path
