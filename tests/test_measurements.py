"""A per-record measurement is declared once (`centroidkv.plan.measurements.register_measurement`) and
reaches the record, the job summary, the W&B row and the tables with no other edit."""

from __future__ import annotations

import json

import pytest

from centroidkv import load_model, load_tokenizer
from centroidkv.plan.measurements import DECODED, MEASUREMENTS, Measurement, register_measurement
from eval.benchmarks.toy import Toy
from eval.evaluate import Evaluator
from eval.run_config import MethodSpec
from eval.runner import summarize
from eval.wandb_logger import WandbLogger, table_columns

pytestmark = pytest.mark.usefixtures("one_thread")

NAME, TITLE = "kv_entries_total", "entries total"


@pytest.fixture
def entries_total():
    """A measurement no code knows about: the entries summed over the layers at the end."""
    measurement = register_measurement(
        Measurement(NAME, TITLE, DECODED, lambda run: sum(run.cache.seq_lengths()))
    )
    yield measurement
    del MEASUREMENTS[NAME]


class FakeRun:
    def __init__(self):
        self.logged: list[dict] = []

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append(metrics)


def test_a_measurement_declared_once_reaches_record_summary_wandb_and_table(entries_total, tmp_path):
    from scripts.reports.tables import load, make_tables

    model, tokenizer = load_model("tiny-llama")[0], load_tokenizer("smollm2-135m")
    specs = (MethodSpec("full", 1.0), MethodSpec("streaming_llm", 0.5))
    benchmark = Toy(lengths=(256,), n_samples=1)
    evaluator = Evaluator(model, tokenizer, specs, benchmark)
    sample = benchmark.load(tokenizer)[0]
    records = [
        {**r, "model": "tiny-llama", "experiment": "e", "job": "j"}
        for r in evaluator.run_sample(sample, list(specs), cap=4)
    ]
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    full, streaming = records
    assert full[NAME] == full["kv_len"] * model.config.num_hidden_layers  # every layer keeps every entry
    assert 0 < streaming[NAME] < full[NAME]

    assert summarize(records)[f"streaming_llm@0.5/{NAME}"] == streaming[NAME]

    logger = WandbLogger.__new__(WandbLogger)  # no W&B run: only its row of metrics
    logger.run, logger.step = FakeRun(), 0
    logger.log_record(streaming)
    assert logger.run.logged[0][f"toy/streaming_llm@0.5/{NAME}"] == streaming[NAME]
    assert NAME in table_columns()

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tables = make_tables(load([path]))
    _, table, _ = tables["measurements"]
    assert table[TITLE].tolist() == [full[NAME], streaming[NAME]]


def test_a_taken_measurement_name_is_refused():
    with pytest.raises(ValueError, match="taken"):
        register_measurement(Measurement("tpot", "other", DECODED, lambda run: 0))
