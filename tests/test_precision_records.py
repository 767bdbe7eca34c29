"""kv_precision=model keeps today's records: a tiny toy job gives exactly the records (and the job
identity) that the code before storage precisions gave, with the key left out and set to model.

`tests/fixtures/records_before_precision.json` was written by the job of `run_toy_job` on the code
before storage precisions (main at the merge of the precision work, with the counted query windows of
7ef62f8 merged in, and short prompts: its CentroidKV runs at 0.25 succeed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eval.config import CONFIG_DIR, build_run_config, store_configs
from eval.records import read_records
from eval.runner import config_yaml_of, run_job

pytestmark = pytest.mark.usefixtures("one_thread")

BEFORE = Path(__file__).resolve().parent / "fixtures" / "records_before_precision.json"
FIELDS = ("sample_id", "method", "variant", "params", "budget", "prediction", "score", "kv_bytes", "kv_bytes_final",
          "kv_ratio", "kv_budget_ratio", "kv_len", "n_compressions", "n_generated", "status")  # fmt: skip


def compose_tiny(overrides: list[str]):
    """The composed config of a tiny-llama toy job without logging, plus `overrides`."""
    store_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(
            config_name="config", overrides=["model=tiny-llama", "benchmark=toy", "logger=none", *overrides]
        )


def run_toy_job(extra: list[str]) -> dict:
    """The identity and the deterministic fields (no timings) of a small job's records, in order."""
    results = tempfile.mkdtemp()
    cfg = compose_tiny([f"results_dir={results}", "warmup=false", "methods=[full,centroidkv,snapkv,h2o,streaming_llm]",
                        "budgets=[0.25,0.5]", "benchmark.n_samples=2", *extra])  # fmt: skip
    run_config = build_run_config(cfg, "job")
    run_job(run_config, config_yaml_of(run_config, cfg))
    records, _ = read_records(run_config.job_dir / "records.jsonl")
    rows = [{field: record.get(field) for field in FIELDS} for record in records]
    rows.sort(key=lambda row: (row["sample_id"], row["variant"], row["budget"]))
    return json.loads(json.dumps({"identity": run_config.identity(), "records": rows}, sort_keys=True))


@pytest.mark.parametrize("extra", [[], ["kv_precision=model"]])
def test_the_model_precision_gives_the_records_of_before(extra):
    before = json.loads(BEFORE.read_text())
    now = run_toy_job(extra)
    assert now["identity"] == before["identity"]
    assert now["records"] == before["records"]


def test_a_run_level_precision_reaches_every_method_and_its_identity(tmp_path):
    cfg = compose_tiny([f"results_dir={tmp_path}", "methods=[full,snapkv,{name:kivi,params:{kv_precision:int4}}]",
                        "kv_precision=int8"])  # fmt: skip
    run_config = build_run_config(cfg, "job")
    variants = {spec.variant: spec.params["kv_precision"] for spec in run_config.methods}
    assert variants == {"full-int8": "int8", "snapkv-int8": "int8", "kivi-int4": "int4"}
    assert run_config.identity()["methods.snapkv-int8.params.kv_precision"] == "int8"


def test_the_cost_table_shows_what_a_packed_store_ends_holding(tmp_path):
    """A 4-bit store packs its residual group as decoding goes on, so it ends holding fewer bytes than
    it started from: the cost table must show the end as well, or int4 looks as large as it began."""
    from scripts.reports.tables import load, measurements_table

    cfg = compose_tiny([f"results_dir={tmp_path}", "warmup=false", "benchmark.n_samples=1", "budgets=[0.25]",
                        "methods=[{name:centroidkv,params:{kv_precision:int4,kv_residual:8}}]"])  # fmt: skip
    run_config = build_run_config(cfg, "job")
    run_job(run_config, config_yaml_of(run_config, cfg))
    records, _ = read_records(run_config.job_dir / "records.jsonl")
    assert records and all(r["status"] == "ok" for r in records)

    table = measurements_table(load([run_config.job_dir]))
    (row,) = [table.loc[who] for who in table.index if who.endswith("@ 0.25")]
    held_at_end = sum(r["kv_bytes_final"] for r in records) / len(records) / 2**20
    assert row["KV MiB end"] == pytest.approx(held_at_end)
    assert row["KV MiB end"] != pytest.approx(row["KV MiB"])  # the start alone would misstate it
