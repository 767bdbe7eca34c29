"""The method registry: methods are found (one file in baselines/, or a plug-in package through the
entry-point group `centroidkv.methods`), never listed, and tables and figures show them by label."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import baselines
from centroidkv.methods import REGISTRY, method_label, method_names

ROOT = Path(__file__).resolve().parent.parent

# One method file written against the Method interface only: keep every other token of the middle.
METHOD_FILE = '''
"""Keep every other token: a test method (no paper). Parameters: offset (0 or 1), which parity stays."""

from dataclasses import dataclass

import torch

from centroidkv.methods import LayerKV, LayerStats, Method, register


@register
@dataclass
class {cls}(Method):
    name = "{name}"
    label = "{label}"

    offset: int = 0

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        batch, heads, length = kv.log_degree.shape
        order = torch.cat([torch.arange(self.offset, length, 2), torch.arange(1 - self.offset, length, 2)])
        kept = order[:target_len].sort().values.to(kv.keys.device)
        return kv.select(kept.expand(batch, heads, target_len))
'''


def test_every_baselines_module_registers_a_method():
    """Discovery imports each public module of the package: each one contributes a method."""
    names = method_names()
    modules = {cls.__module__ for cls in REGISTRY.values()}
    files = {p.stem for p in Path(baselines.__path__[0]).glob("*.py") if not p.stem.startswith("_")}
    assert files and {f"baselines.{stem}" for stem in files} <= modules
    assert {"full", "centroidkv"} <= set(names)
    init = ast.parse((Path(baselines.__path__[0]) / "__init__.py").read_text())
    assert not any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(init))


def test_labels_come_from_the_class():
    assert method_label("full") == "Full cache" and method_label("centroidkv") == "CentroidKV"
    assert method_label("no_such_method") == "no_such_method"  # old records keep their name


@pytest.fixture
def dropped_method():
    """A method file dropped into baselines/ for the test, removed afterwards (registry included)."""
    name = "every_other_test"
    path = Path(baselines.__path__[0]) / f"{name}.py"
    path.write_text(METHOD_FILE.format(cls="EveryOther", name=name, label="Every-other (test)"))
    try:
        yield name
    finally:
        path.unlink(missing_ok=True)
        for cached in (Path(baselines.__path__[0]) / "__pycache__").glob(f"{name}.*"):
            cached.unlink()
        REGISTRY.pop(name, None)
        sys.modules.pop(f"baselines.{name}", None)


def test_a_dropped_file_is_listed_run_and_shown_under_its_label(dropped_method, tmp_path):
    """One file in baselines/, no other edit: method_names() lists it, scripts/run.py runs it next to
    the full cache, and the tables and figures show it under its label."""
    name = dropped_method
    assert name in method_names()
    assert method_label(name) == "Every-other (test)"

    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "run.py"),
            f"methods=[full,{name}]",
            "budgets=[0.5]",
            "model=tiny-llama",
            "benchmark=ruler",
            "benchmark.tasks=[niah_single_1]",
            "benchmark.lengths=[1024]",
            "benchmark.n_samples=1",
            "benchmark.max_new_tokens=4",
            "logger=none",
            "warmup=false",
            "experiment_name=dropin",
            f"results_dir={tmp_path / 'results'}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in next((tmp_path / "results").rglob("records.jsonl")).open()]
    ours = [r for r in records if r["method"] == name]
    assert len(ours) == 1 and ours[0]["status"] == "ok", ours
    full = next(r for r in records if r["method"] == "full")
    assert 0 < ours[0]["kv_bytes"] < full["kv_bytes"]  # it really compressed

    from scripts.reports.figures import main as figures
    from scripts.reports.tables import main as tables

    assert tables([str(tmp_path / "results" / "dropin"), "--out", str(tmp_path / "tables")]) == 0
    table = (tmp_path / "tables" / "ruler_budget0.5.md").read_text()
    assert "| Every-other (test) |" in table and "| Full cache |" in table
    assert figures([str(tmp_path / "results"), "--out", str(tmp_path / "figures")]) == 0
    assert (tmp_path / "figures" / "dropin_ruler_accuracy_vs_budget.png").stat().st_size > 5000


def test_variants_are_shown_by_their_name(tmp_path):
    """Records with a `variant` are grouped and labelled by it; records without one by their class."""
    from scripts.reports.tables import load

    base = dict(benchmark="ruler", task="niah_single_1", length=1024, status="ok", score=50.0)
    records = [
        {**base, "sample_id": "a", "method": "full", "params": {}, "budget": 1.0},
        {**base, "sample_id": "a", "method": "snapkv", "params": {"window_size": 16}, "budget": 0.5},
        {**base, "sample_id": "a", "method": "snapkv", "params": {"window_size": 32}, "budget": 0.5},
        {
            **base,
            "sample_id": "a",
            "method": "snapkv",
            "params": {"window_size": 8},
            "budget": 0.5,
            "variant": "snapkv_w8",
        },
    ]
    job = tmp_path / "exp" / "job"
    job.mkdir(parents=True)
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    df = load([tmp_path / "exp"])
    assert list(df["label"]) == [
        "Full cache",
        "SnapKV (window_size=16)",
        "SnapKV (window_size=32)",
        "snapkv_w8",
    ]
    assert df.loc[df["label"] == "Full cache", "method_rank"].item() < df["method_rank"].min() + 1


PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "centroidkv-plugin-test"
version = "0.0.1"

[project.entry-points."centroidkv.methods"]
every_other = "centroidkv_plugin_test.every_other"

[tool.setuptools]
packages = ["centroidkv_plugin_test"]
"""

CHECK = """
import torch
from centroidkv import CompressedCache, get_method, load_model, method_names
from centroidkv.methods import method_label

assert "plugin_every_other" in method_names(), method_names()
assert method_label("plugin_every_other") == "Every-other (plug-in)"
model, _ = load_model("tiny-llama")
cache = CompressedCache(get_method("plugin_every_other", offset=1), budget=0.5, max_new_tokens=0)
ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(0))
model(ids, past_key_values=cache)
reference = CompressedCache("full", 1.0, 0)
model(ids, past_key_values=reference)
layer, full = cache.layers[0], reference.layers[0]
assert layer.main.length == 150, layer.main.length
middle = full.keys[:, :, 16:-64][:, :, 1::2][:, :, : 150 - 80]  # the odd tokens of the middle
assert torch.equal(layer.keys[:, :, 16:-64], middle)
print("plugin ok")
"""


def test_a_plugin_package_is_found_through_the_entry_point(tmp_path):
    """A separate package, built and installed into a temporary folder (not the venv), registers its
    method through the entry-point group; it is listed and compresses a tiny model's cache."""
    source = tmp_path / "src"
    package = source / "centroidkv_plugin_test"
    package.mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT)
    (package / "__init__.py").write_text("")
    (package / "every_other.py").write_text(
        METHOD_FILE.format(cls="PluginEveryOther", name="plugin_every_other", label="Every-other (plug-in)")
    )
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    check = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)], capture_output=True, text=True, env=env, timeout=300
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert "plugin ok" in check.stdout
    # Without the folder on the path the method is unknown: the test really goes through the plug-in.
    env["PYTHONPATH"] = str(ROOT)
    without = subprocess.run(
        [sys.executable, "-c", "from centroidkv import method_names; print(method_names())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert without.returncode == 0 and "plugin_every_other" not in without.stdout


def test_methods_and_benchmarks_refuse_a_taken_name_in_the_same_form():
    """One registry type (`centroidkv.registry.Registry`) for both: a second class under a taken name
    is refused with one line naming both classes, and the first stays; the same class again is fine."""
    from dataclasses import dataclass

    from centroidkv.methods import Method, register
    from eval.benchmarks import REGISTRY as BENCHMARKS
    from eval.benchmarks import Benchmark, benchmark_names, register_benchmark

    method_names()
    benchmark_names()

    @dataclass
    class OtherCentroidKV(Method):
        name = "centroidkv"

    @dataclass(frozen=True)
    class OtherToy(Benchmark):
        name = "toy"

    here = f"{__name__}.test_methods_and_benchmarks_refuse_a_taken_name_in_the_same_form.<locals>"
    with pytest.raises(ValueError) as method_error:
        register(OtherCentroidKV)
    with pytest.raises(ValueError) as benchmark_error:
        register_benchmark(OtherToy)
    assert str(method_error.value) == (
        f"method name 'centroidkv' is taken by centroidkv.centroidkv.CentroidKV; {here}.OtherCentroidKV "
        "needs another name"
    )
    assert str(benchmark_error.value) == (
        f"benchmark name 'toy' is taken by eval.benchmarks.toy.Toy; {here}.OtherToy needs another name"
    )
    assert REGISTRY["centroidkv"].__module__ == "centroidkv.centroidkv"
    assert BENCHMARKS["toy"].__module__ == "eval.benchmarks.toy"
    assert register(REGISTRY["centroidkv"]) is REGISTRY["centroidkv"]  # a module imported twice
    assert register_benchmark(BENCHMARKS["toy"]) is BENCHMARKS["toy"]
