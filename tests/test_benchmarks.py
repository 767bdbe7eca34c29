"""The benchmark registry: discovery, validation, scorers, and a new benchmark as one module."""

from __future__ import annotations

import sys
import textwrap

import pytest

import eval.benchmarks as benchmarks
from eval.benchmarks import REGISTRY, benchmark_names, build_benchmark


def test_the_four_benchmarks_are_discovered_and_their_defaults_are_valid():
    assert {"ruler", "longbench", "niah", "toy"} <= set(benchmark_names())
    for name in ("ruler", "longbench", "niah", "toy"):
        benchmark, errors = build_benchmark({"name": name})
        assert errors == [] and benchmark.name == name
        assert benchmark.params()["name"] == name


def test_ruler_default_tasks_are_the_generator_s():
    from eval.benchmarks.ruler import TASK_NAMES

    assert build_benchmark({"name": "ruler"})[0].tasks == TASK_NAMES


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"name": "bogus"}, "benchmark.name: unknown benchmark 'bogus'"),
        ({"name": "toy", "n_sample": 1}, "benchmark.n_sample: toy has no such parameter"),
        ({"name": "toy", "depths": [50]}, "benchmark.depths: toy has no such parameter"),
        ({"name": "ruler", "lengths": [512]}, "RULER needs lengths >= 1024"),
        ({"name": "ruler", "tasks": ["niah_single_9"]}, "unknown RULER task 'niah_single_9'"),
        ({"name": "niah", "depths": [120]}, "benchmark.depths: each depth must be a percentage"),
        ({"name": "niah", "tasks": ["vt"]}, "NIAH has the one task niah"),
        ({"name": "longbench", "lengths": [4096, 8192]}, "LongBench takes one truncation length"),
        ({"name": "longbench", "tasks": ["narrativeqa_e"]}, "narrativeqa is not in LongBench-E"),
        ({"name": "longbench", "data_dir": "/no/such/folder"}, "benchmark.data_dir: no such folder"),
        ({"name": "toy", "n_samples": 0}, "benchmark.n_samples: must be an integer >= 1"),
        ({"name": "toy", "max_new_tokens": 0}, "benchmark.max_new_tokens"),
    ],
)
def test_each_bad_benchmark_value_gives_one_line(raw, fragment):
    _, errors = build_benchmark(raw)
    assert len(errors) == 1 and fragment in errors[0], errors


@pytest.mark.parametrize(
    "name, sample, prediction, expected",
    [
        ("toy", {"answers": ["1234567"]}, "It is 1234567.", 100.0),
        ("toy", {"answers": ["1234567"]}, "It is 123456.", 0.0),
        ("niah", {"answers": ["7654321"]}, "the number is 7654321", 100.0),
        ("niah", {"answers": ["7654321"]}, "7 6 5 4 3 2 1", 0.0),
        ("longbench", {"task": "trec", "answers": ["Location"], "all_classes": ["Location", "Person"]}, "Location", 100.0),
        ("longbench", {"task": "hotpotqa", "answers": ["red apple pie"]}, "a big red apple", 200 / 3),
        ("longbench", {"task": "passage_count", "answers": ["3"]}, "3 4", 50.0),
    ],
)  # fmt: skip
def test_benchmark_scorers_on_hand_made_predictions(name, sample, prediction, expected):
    # hotpotqa: the article dropped, pred {big, red, apple} vs gold {red, apple, pie}: P = R = F1 = 2/3;
    # passage_count: one of the two numbers in the prediction is right -> 1/2.
    benchmark = build_benchmark({"name": name})[0]
    assert benchmark.score(sample, prediction) == pytest.approx(expected)


def test_samples_are_interleaved_across_tasks():
    class FakeTokenizer:
        pass

    toy = build_benchmark({"name": "toy", "tasks": ["a", "b"], "lengths": [64, 128], "n_samples": 2})[0]
    order = [(s["task"], s["length"], s["index"]) for s in toy.samples(FakeTokenizer())]
    assert order[:4] == [("a", 64, 0), ("a", 128, 0), ("b", 64, 0), ("b", 128, 0)]
    assert sorted(order) == [(t, n, i) for t in "ab" for n in (64, 128) for i in range(2)]


MODULE = '''
"""Echo: the answer is in the prompt (a test benchmark)."""
from dataclasses import dataclass

from eval.benchmarks import Benchmark, register_benchmark


@register_benchmark
@dataclass(frozen=True)
class Echo(Benchmark):
    name = "{name}"
    tasks: tuple[str, ...] = ("echo",)
    lengths: tuple[int, ...] = (64,)
    word: str = "banana"

    def validate(self):
        errors = super().validate()
        if not self.word.isalpha():
            errors.append(f"benchmark.word: must be letters, got {{self.word!r}}")
        return errors

    def load(self, tokenizer):
        return [
            dict(task="echo", index=i, length=64, input=f"Repeat the word {{self.word}}.", answers=[self.word],
                 max_new_tokens=4)
            for i in range(self.n_samples)
        ]

    def score(self, sample, prediction):
        return 100.0 if sample["answers"][0] in prediction else 25.0
'''


def test_a_new_benchmark_is_one_module_in_the_folder(tmp_path, monkeypatch):
    """A module dropped into eval/benchmarks/ (here: a folder added to the package's path) is found,
    validated, composed as `benchmark=<name>` and run, with no other file touched."""
    from hydra import compose, initialize_config_dir

    from eval.config import CONFIG_DIR, build_run_config, store_configs
    from eval.records import read_records
    from eval.runner import config_yaml_of, run_job

    (tmp_path / "echo_test.py").write_text(textwrap.dedent(MODULE.format(name="echo_test")))
    monkeypatch.setattr(benchmarks, "__path__", [*benchmarks.__path__, str(tmp_path)])
    try:
        assert "echo_test" in benchmark_names()
        store_configs()
        overrides = ["model=tiny-llama", "benchmark=echo_test", "benchmark.n_samples=2", "logger=none",
                     "warmup=false", "method=full", f"results_dir={tmp_path / 'results'}"]  # fmt: skip
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
            bad = compose(config_name="config", overrides=[*overrides, "benchmark.word=x1"])
        with pytest.raises(ValueError, match="benchmark.word: must be letters"):
            build_run_config(bad, "job")
        cfg = build_run_config(raw, "job")
        run_job(cfg, config_yaml_of(cfg, raw))
        records, _ = read_records(cfg.job_dir / "records.jsonl")
        assert [(r["benchmark"], r["task"], r["status"]) for r in records] == [
            ("echo_test", "echo", "ok")
        ] * 2
        assert all(r["score"] in (100.0, 25.0) for r in records)  # its own scorer
    finally:
        REGISTRY.pop("echo_test", None)
        sys.modules.pop("eval.benchmarks.echo_test", None)


def test_a_benchmark_from_an_installed_package_is_found_by_its_entry_point(tmp_path, monkeypatch):
    package = tmp_path / "echo_plugin"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(MODULE.format(name="echo_plugin_test")))
    info = tmp_path / "echo_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[centroidkv.benchmarks]\necho = echo_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "echo_plugin_test" in benchmark_names()
        benchmark, errors = build_benchmark({"name": "echo_plugin_test", "word": "kiwi"})
        assert errors == [] and benchmark.load(None)[0]["answers"] == ["kiwi"]
    finally:
        REGISTRY.pop("echo_plugin_test", None)
        sys.modules.pop("echo_plugin", None)
