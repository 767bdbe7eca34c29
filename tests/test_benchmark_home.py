"""A benchmark is one home: one file dropped into eval/benchmarks/, no other file edited, is run by the
runner and gets its score tables and figures from scripts/tables.py and scripts/figures.py (which
never name a benchmark and ask its report: here the default one). Also: a report's task labels,
families and switches reach the tables and figures."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pandas as pd

import eval.benchmarks as benchmarks
from eval.benchmarks import REGISTRY, Report, benchmark_names, benchmark_report

ROOT = Path(__file__).resolve().parent.parent
HOME = Path(benchmarks.__file__).parent

# Two generated tasks, deterministic, scored by exact match; nothing about reporting.
MODULE = '''
"""A tiny benchmark written by tests/test_benchmark_home.py, which removes it again."""

from dataclasses import dataclass

from eval.benchmarks import Benchmark, Sample, register_benchmark


@register_benchmark
@dataclass(frozen=True)
class HomeCheck(Benchmark):
    name = "{name}"

    tasks: tuple[str, ...] = ("copy_word", "copy_number")
    lengths: tuple[int, ...] = (256,)
    n_samples: int = 2
    max_new_tokens: int | None = 4

    def load(self, tokenizer) -> list[Sample]:
        samples = []
        for task in self.tasks:
            for length in self.lengths:
                for index in range(self.n_samples):
                    answer = ("kiwi", "mango")[index] if task == "copy_word" else str(1000 + index)
                    context = f"The word to remember is {{answer}}. " * (length // 10)
                    question = "Which word is to be remembered?"
                    samples.append(
                        dict(task=task, index=index, length=length, input=context + question,
                             context=context, question=question, answers=[answer], max_new_tokens=4)
                    )
        return samples

    def score(self, sample: Sample, prediction: str) -> float:
        return 100.0 if prediction.strip() == sample["answers"][0] else 0.0
'''


def _python_files() -> list[str]:
    return sorted(p.name for p in HOME.glob("*.py"))


def test_a_benchmark_dropped_as_one_file_gets_its_tables_and_figures(tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.config import CONFIG_DIR, build_run_config, store_configs
    from eval.records import read_records
    from eval.runner import config_yaml_of, run_job
    from scripts.reports.figures import main as figures
    from scripts.reports.tables import main as tables

    name = f"home_check_{os.getpid()}"  # one per test process: other runs may share the tree
    path = HOME / f"{name}.py"
    before = _python_files()
    path.write_text(textwrap.dedent(MODULE.format(name=name)).lstrip())
    try:
        assert name in benchmark_names()
        store_configs()
        overrides = [f"benchmark={name}", "model=tiny-llama", "methods=[full,streaming_llm]", "budgets=[0.5]",
                     "logger=none", "warmup=false", "experiment_name=home", f"results_dir={tmp_path / 'results'}"]  # fmt: skip
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
        cfg = build_run_config(raw, "job")
        run_job(cfg, config_yaml_of(cfg, raw))
        records, _ = read_records(cfg.job_dir / "records.jsonl")
        assert {(r["benchmark"], r["task"], r["method"], r["status"]) for r in records} == {
            (name, task, method, "ok")
            for task in ("copy_word", "copy_number")
            for method in ("full", "streaming_llm")
        }
        assert len(records) == 8 and all(r["score"] in (0.0, 100.0) for r in records)  # its own scorer

        # The default report: a table of tasks (sorted) x methods at the budget, with Avg, and the ranking.
        assert tables([str(tmp_path / "results" / "home"), "--out", str(tmp_path / "tables")]) == 0
        table = (tmp_path / "tables" / f"{name}_budget0.5.md").read_text().splitlines()
        assert table[0].startswith(f"**{name} scores (0-100) at budget 0.5")
        assert table[2] == "| Method | copy_number | copy_word | Avg | KV | n | failed |"
        assert [row.split("|")[1].strip() for row in table[4:]] == ["Full cache", "StreamingLLM"]
        assert all(row.split("|")[-3].strip() == "4" for row in table[4:])  # n: 2 samples x 2 tasks
        ranking = (tmp_path / "tables" / f"{name}_ranking.md").read_text()
        assert "| Full cache |" in ranking and "| StreamingLLM |" in ranking

        assert figures([str(tmp_path / "results"), "--out", str(tmp_path / "figures")]) == 0
        for figure in ("accuracy_vs_budget", "score_vs_kv"):
            assert (tmp_path / "figures" / f"home_{name}_{figure}.png").stat().st_size > 5000, figure
    finally:
        path.unlink(missing_ok=True)
        Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)
        REGISTRY.pop(name, None)
        sys.modules.pop(f"eval.benchmarks.{name}", None)
    assert _python_files() == before  # the file is gone and no other was added


def _frame(folder: Path, benchmark: str, tasks: tuple[str, ...]) -> pd.DataFrame:
    """Records of two samples per task: the full cache, and SnapKV at 0.25 and 0.5, as tables.load reads them."""
    from scripts.reports import tables

    rows = [
        {"benchmark": benchmark, "task": task, "length": 1024, "sample_id": f"{task}-{i}", "method": method,
         "params": {}, "budget": budget, "status": "ok", "score": score, "model": "tiny",
         "experiment": "exp", "job": "j"}
        for task in tasks
        for i in range(2)
        for method, budget, score in (("full", 1.0, 100.0), ("snapkv", 0.25, 50.0), ("snapkv", 0.5, 75.0))
    ]  # fmt: skip
    job = folder / "exp" / "j"
    job.mkdir(parents=True)
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tables.load([folder / "exp"])


def test_a_report_s_labels_families_and_switches_reach_the_tables_and_figures(tmp_path, monkeypatch):
    from scripts.reports import figures, tables

    class Reported(benchmarks.Benchmark):
        name = "reported_check"

        @classmethod
        def report(cls) -> Report:
            return Report(
                title="Reported",
                task_labels={"b": "Bee", "a": "Ay"},
                families={"first": ("a",), "second": ("b", "c")},
                ranking=False,
            )

    monkeypatch.setitem(REGISTRY, "reported_check", Reported)
    df = _frame(tmp_path, "reported_check", ("a", "b", "c"))
    made = tables.make_tables(df)
    caption, table, _ = made["reported_check_budget0.25"]
    assert caption.startswith("Reported scores (0-100) at budget 0.25")
    assert list(table.columns[:4]) == ["Bee", "Ay", "c", "Avg"]  # labelled, in the report's order
    assert "reported_check_summary" in made and "reported_check_ranking" not in made
    paths = {p.name for p in figures.make_figures(df, tmp_path / "figures")}
    assert {"exp_reported_check_accuracy_vs_budget.png", "exp_reported_check_accuracy_by_family.png"} <= paths
    assert not any("heatmap" in p for p in paths)  # not asked for

    # A benchmark no registered class names (e.g. since removed) gets the default report.
    assert benchmark_report("no_such_benchmark") == Report(title="no_such_benchmark")
