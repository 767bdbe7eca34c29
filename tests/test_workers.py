"""workers=N: a job's samples over N processes give the records one process gives (timings apart),
written by one writer; a bad value is one line."""

from __future__ import annotations

import pytest

from eval.records import read_records, record_key
from scripts.equivalence import MEASURED_FIELDS
from tests.test_harness import config_error_line, run_cfg

# where and when a record ran, not what it computed
PLACE_FIELDS = {"job", "load_1min", "n_cores"}


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in MEASURED_FIELDS and k not in PLACE_FIELDS}


def test_two_workers_give_the_records_of_one(tmp_path):
    from eval.runner import config_yaml_of, run_job

    overrides = ["methods=[full,centroidkv,snapkv]", "budgets=[0.5]", "benchmark.n_samples=3"]
    by_workers = {}
    for workers in (1, 2):
        cfg, raw = run_cfg(tmp_path / f"w{workers}", [*overrides, f"workers={workers}"])
        assert cfg.workers == workers and cfg.identity() == run_cfg(tmp_path, overrides)[0].identity()
        run_job(cfg, config_yaml_of(cfg, raw))
        records, dirty = read_records(cfg.job_dir / "records.jsonl")
        assert not dirty and all(r["status"] == "ok" for r in records)
        by_workers[workers] = {record_key(r): comparable(r) for r in records}
    assert len(by_workers[1]) == 3 * 3
    assert by_workers[2] == by_workers[1]


@pytest.mark.parametrize("value", ["0", "two", "true"])
def test_a_bad_worker_count_is_one_line(tmp_path, value):
    assert "workers: must be an integer >= 1" in config_error_line(tmp_path, [f"workers={value}"])


def test_with_workers_the_parent_neither_warms_up_nor_keeps_its_model(tmp_path, monkeypatch):
    """The workers load, warm up and run their own models: the parent's copy is let go before they
    start (no third model in memory beside two workers) and never runs."""
    import gc
    import weakref

    import eval.workers
    from eval.evaluate import Evaluator
    from eval.runner import config_yaml_of, run_job

    loaded, seen = [], {}
    load = eval.workers.load_model_for

    def load_and_watch(cfg):
        model, tokenizer = load(cfg)
        loaded.append(weakref.ref(model))
        return model, tokenizer

    def parent_must_not_run(self, *args, **kwargs):
        raise AssertionError("the parent ran its model")

    spawn_workers = eval.workers.run_in_workers

    def look_then_spawn(cfg, work, keep, sample_done):
        gc.collect()
        seen["parent model alive"] = any(ref() is not None for ref in loaded)
        seen["samples"] = len(work)
        spawn_workers(cfg, work, keep, sample_done)

    monkeypatch.setattr(eval.workers, "load_model_for", load_and_watch)
    monkeypatch.setattr(eval.workers, "run_in_workers", look_then_spawn)
    monkeypatch.setattr(Evaluator, "warm_up", parent_must_not_run)
    monkeypatch.setattr(Evaluator, "run_prompt", parent_must_not_run)
    overrides = ["methods=[full,centroidkv]", "budgets=[0.5]", "benchmark.n_samples=2", "workers=2"]
    cfg, raw = run_cfg(tmp_path, overrides)
    run_job(cfg, config_yaml_of(cfg, raw))
    assert seen == {"parent model alive": False, "samples": 2}
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert len(records) == 4 and all(r["status"] == "ok" for r in records)
