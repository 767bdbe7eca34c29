"""Tables and figures never pool two configurations: records of one label whose jobs' identities
differ get their own rows (named by the keys that differ), except for the keys that only place
results or choose samples (tables.NON_SPLITTING_KEYS). Also: the measured KV column, the score vs
KV and score vs parameter figures, one style per label, and atomic, symlink-safe writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from scripts.reports import figure_styles, figures, tables

IDENTITY: dict[str, Any] = {
    "model.name": "tiny",
    "model.dtype": "float32",
    "model.device": "cpu",
    "warmup": False,
    "benchmark.name": "ruler",
    "benchmark.tasks": ["niah_single_1", "vt"],
    "benchmark.lengths": [1024],
    "benchmark.n_samples": 2,
    "benchmark.seed": 0,
    "benchmark.max_new_tokens": 4,
    "methods.full.method": "full",
    "methods.full.budgets": [1.0],
    "methods.centroidkv.method": "centroidkv",
    "methods.centroidkv.params.r_init": 0.3,
    "methods.centroidkv.budgets": [0.5],
}


def record(method: str, budget: float, task: str, sample: int, score: float, **extra) -> dict[str, Any]:
    return {"benchmark": "ruler", "task": task, "length": 1024, "sample_id": f"{task}-{sample}",
            "method": method, "variant": extra.pop("variant", method), "params": extra.pop("params", {}),
            "budget": budget, "status": "ok", "score": score, "model": "tiny", **extra}  # fmt: skip


def job(
    root: Path, name: str, records: list[dict], identity: dict[str, Any] | None = None, **changes
) -> Path:
    """A job folder `root/exp/<name>` with its records and (unless identity is None) config.yaml."""
    folder = root / "exp" / name
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if identity is not None:
        config = {"experiment_name": "exp", "identity": {**identity, **changes}}
        (folder / "config.yaml").write_text(OmegaConf.to_yaml(config))
    return folder


def two_methods(samples: range, ours: float = 50.0, **extra) -> list[dict]:
    """Full cache (100) and CentroidKV at budget 0.5 (`ours`) on both tasks for `samples`."""
    return [
        record(method, budget, task, i, score, **extra)
        for i in samples
        for task in ("niah_single_1", "vt")
        for method, budget, score in (("full", 1.0, 100.0), ("centroidkv", 0.5, ours))
    ]


def rows_of(markdown: str) -> dict[str, list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    return {
        cells[0]: dict(zip(header[1:], cells[1:], strict=True))
        for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[1:])
    }


def budget_table(tmp_path: Path) -> dict[str, dict[str, str]]:
    assert tables.main([str(tmp_path / "exp"), "--out", str(tmp_path / "tables")]) == 0
    return rows_of((tmp_path / "tables" / "ruler_budget0.5.md").read_text())


# ------------------------------------------------------------------------------------------ pooling
def test_jobs_differing_in_max_new_tokens_form_separate_rows(tmp_path):
    job(tmp_path, "a", two_methods(range(2), ours=50.0), IDENTITY)
    job(tmp_path, "b", two_methods(range(2), ours=0.0), IDENTITY, **{"benchmark.max_new_tokens": 6})
    rows = budget_table(tmp_path)
    assert list(rows) == [
        "Full cache (max_new_tokens=4)",
        "Full cache (max_new_tokens=6)",
        "CentroidKV (max_new_tokens=4)",
        "CentroidKV (max_new_tokens=6)",
    ]
    assert {row["n"] for row in rows.values()} == {"4"}  # 2 samples x 2 tasks each, never 8
    assert rows["CentroidKV (max_new_tokens=4)"]["Avg"] == "**50.0**"
    assert rows["CentroidKV (max_new_tokens=6)"]["Avg"] == "0.0"


def test_jobs_differing_only_in_placement_or_selection_keys_form_one_row(tmp_path):
    assert {"results_dir", "experiment_name", "benchmark.n_samples"} <= tables.NON_SPLITTING_KEYS
    job(tmp_path, "a", two_methods(range(2)), IDENTITY, results_dir="/x")
    job(tmp_path, "b", two_methods(range(2, 5)), IDENTITY, results_dir="/y", **{"benchmark.n_samples": 3})
    rows = budget_table(tmp_path)
    assert list(rows) == ["Full cache", "CentroidKV"]
    assert rows["CentroidKV"]["n"] == "10"  # 5 samples x 2 tasks, one configuration


def test_own_budgets_and_other_variants_keys_do_not_split(tmp_path):
    """A budget sweep (`methods.<v>.budgets`) and a job with one more method leave the full cache
    one row; a variant's own parameters split it, shortest names first."""
    job(tmp_path, "a", two_methods(range(2)), IDENTITY)
    more = {"methods.centroidkv.budgets": [0.25], "methods.snapkv.method": "snapkv",
            "methods.snapkv.params.window_size": 8, "methods.snapkv.budgets": [0.25]}  # fmt: skip
    job(tmp_path, "b", [record("full", 1.0, t, 9, 100.0) for t in ("niah_single_1", "vt")], IDENTITY, **more)
    job(tmp_path, "c", two_methods(range(2)), IDENTITY, **{"methods.centroidkv.params.r_init": 0.5})
    rows = budget_table(tmp_path)
    assert list(rows) == ["Full cache", "CentroidKV (r_init=0.3)", "CentroidKV (r_init=0.5)"]
    # a's and c's full-cache records are the same samples in the same configuration: counted once
    # (issue 40, item 4; before, n was 10), plus b's two.
    assert rows["Full cache"]["n"] == "6"


def test_short_key_names_are_unambiguous():
    names = tables.short_key_names(["benchmark.seed", "method.params.seed", "model.name", "warmup"])
    assert names == {
        "benchmark.seed": "benchmark.seed",
        "method.params.seed": "params.seed",
        "model.name": "model.name",
        "warmup": "warmup",
    }


def test_records_without_config_still_split_by_params(tmp_path):
    job(tmp_path, "a", two_methods(range(1), params={"r_init": 0.1}))
    job(tmp_path, "b", two_methods(range(1), params={"r_init": 1.0}))
    df = tables.load([tmp_path / "exp"])
    assert set(df.loc[df["method"] == "centroidkv", "label"]) == {
        "CentroidKV (r_init=0.1)",
        "CentroidKV (r_init=1.0)",
    }


# ------------------------------------------------------------------------------------- KV column
def test_kv_column_is_the_mean_measured_ratio_and_captions_name_unit_and_split(tmp_path):
    records = two_methods(range(2), budget_unit="bytes", split="dev")
    ratios = iter([0.9, 0.41, 0.9, 0.52, 0.9, 0.47, 0.9, 0.44])
    for r in records:
        r["kv_budget_ratio"] = next(ratios)
    del records[1]["kv_budget_ratio"]  # an older record: falls back to kv_ratio
    records[1]["kv_ratio"] = 0.5
    job(tmp_path, "a", records, IDENTITY)
    rows = budget_table(tmp_path)
    assert list(rows["CentroidKV"]) == ["S-NIAH-1", "VT", "Avg", "KV", "n", "failed"]
    assert rows["CentroidKV"]["KV"] == f"{(0.5 + 0.52 + 0.47 + 0.44) / 4:.2f}" == "0.48"
    # The full cache is its own reference (issue 40: it showed its 0.90 against prompt + new tokens).
    assert rows["Full cache"]["KV"] == "1.00"
    caption = (tmp_path / "tables" / "ruler_budget0.5.md").read_text().splitlines()[0]
    assert "budget 0.5 in bytes" in caption and "dev split" in caption


def test_kv_column_is_what_the_cache_held_at_the_end_and_kept_all_is_counted(tmp_path):
    """Issue 39 M1: an int4 store ends under what it held after compression (its residual is packed)
    while a 16-bit one ends over it; the KV column compares what each held at the end, and samples
    on which a method kept every token (its budget bought no compression) are counted."""
    records = two_methods(range(2), budget_unit="bytes")
    for r in records:
        if r["method"] == "centroidkv":
            r.update(kv_budget_ratio=0.125, kv_final_ratio=0.114, kept_every_token=r["task"] == "vt")
    job(tmp_path, "a", records, IDENTITY)
    rows = budget_table(tmp_path)
    assert rows["CentroidKV"]["KV"] == "0.11"  # not the 0.12 right after compression
    assert rows["CentroidKV"]["kept all"] == "2" and rows["Full cache"]["kept all"] == "0"


def test_a_full_length_cache_in_fewer_bits_keeps_its_measured_ratio(tmp_path):
    """The full cache is 1.00 of its own reference, but KIVI (no eviction, 2-bit codes) stores 0.21 of
    the bytes: it showed 1.00 before (every method that does not compress was taken as the reference)."""
    records = [
        record("full", 1.0, "niah_single_1", 0, 100.0, kv_final_ratio=0.97),
        record("full", 1.0, "niah_single_1", 1, 100.0, kv_final_ratio=0.97),
        record("kivi", 1.0, "niah_single_1", 0, 50.0, kv_final_ratio=0.21, params={"kv_precision": "int2"}),
        record("kivi", 1.0, "niah_single_1", 1, 50.0, kv_final_ratio=0.23, params={"kv_precision": "int2"}),
    ]
    job(tmp_path, "a", records, IDENTITY)
    ratios = tables.kv_ratio(tables.load([tmp_path])).round(2).tolist()
    assert sorted(ratios) == [0.21, 0.23, 1.0, 1.0]


def test_kv_column_without_measurement_shows_a_dash(tmp_path):
    job(tmp_path, "a", two_methods(range(1)), IDENTITY)
    assert budget_table(tmp_path)["CentroidKV"]["KV"] == "-"


# ------------------------------------------------------------------------------------------ figures
@pytest.fixture
def drawn(monkeypatch):
    """The figures `_save` was given, by name (nothing is written)."""
    saved: dict[str, Any] = {}
    monkeypatch.setattr(figures, "_save", lambda fig, out, name: saved.setdefault(name, fig) and [out / name])
    return saved


def test_score_vs_kv_plots_average_score_against_mean_measured_ratio(tmp_path, drawn):
    records = []
    for budget, ratio, score in ((0.25, 0.3, 20.0), (0.5, 0.6, 60.0)):
        for i in range(2):
            for task, bonus in (("niah_single_1", 0.0), ("vt", 10.0)):
                r = record("centroidkv", budget, task, i, score + bonus, kv_budget_ratio=ratio + 0.02 * i)
                records.append(r)
    records += [record("full", 1.0, t, 0, 100.0, kv_budget_ratio=1.0) for t in ("niah_single_1", "vt")]
    job(tmp_path, "a", records, IDENTITY)
    figures.make_figures(tables.load([tmp_path / "exp"]), tmp_path)
    ax = drawn["exp_ruler_score_vs_kv"].axes[0]
    line = next(line for line in ax.lines if line.get_label() == "CentroidKV")
    assert list(line.get_xdata()) == pytest.approx([0.31, 0.61])
    assert list(line.get_ydata()) == pytest.approx([25.0, 65.0])


def test_every_variant_has_its_own_style(tmp_path):
    records = [record("full", 1.0, "vt", 0, 100.0)] + [
        record("centroidkv", 0.5, "vt", 0, 50.0, variant=v, params={"r_init": r})
        for v, r in (("ckv_a", 0.1), ("ckv_b", 0.3))
    ]
    job(tmp_path, "a", records)
    styles = figure_styles.label_styles(tables.load([tmp_path / "exp"]))
    a, b = styles["ckv_a"], styles["ckv_b"]  # one method: its colour and marker, another line and fill
    assert (a["linestyle"], a["fillstyle"]) != (b["linestyle"], b["fillstyle"])
    pairs = {(tuple(color), marker) for color, marker in figure_styles.PAIRS}
    assert len(pairs) == len(figure_styles.PAIRS) >= 40  # distinct colour-marker pairs for methods


def test_score_vs_param_names_the_swept_parameters(tmp_path, drawn):
    for name, r_init, schedule, score in (("a", 0.1, "linear", 40.0), ("b", 0.3, "cosine", 80.0)):
        changes = {"methods.centroidkv.params.r_init": r_init, "methods.centroidkv.params.schedule": schedule}
        job(tmp_path, name, two_methods(range(1), ours=score), IDENTITY, **changes)
    figures.make_figures(tables.load([tmp_path / "exp"]), tmp_path)
    ax = drawn["exp_ruler_score_vs_param"].axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["r_init=0.1, schedule=linear", "r_init=0.3, schedule=cosine"]
    series = next(line for line in ax.lines if line.get_label() == "budget 0.5")
    assert list(series.get_ydata()) == [40.0, 80.0]


def test_one_budget_is_centred_on_the_accuracy_axis(tmp_path, drawn):
    job(tmp_path, "a", two_methods(range(1)), IDENTITY)
    figures.make_figures(tables.load([tmp_path / "exp"]), tmp_path)
    low, high = drawn["exp_ruler_accuracy_vs_budget"].axes[0].get_xlim()
    assert low < 0.5 < high and (0.5 - low) == pytest.approx(high - 0.5) and high - low < 0.5


# ------------------------------------------------------------------------------------------- writes
def test_a_failed_write_leaves_the_previous_table_and_figure_whole(tmp_path, monkeypatch, capsys):
    job(tmp_path, "a", two_methods(range(1)), IDENTITY)
    out = tmp_path / "out"
    assert tables.main([str(tmp_path / "exp"), "--out", str(out)]) == 0
    assert figures.main([str(tmp_path / "exp"), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "ruler_budget0.5.md" in before and "exp_ruler_accuracy_vs_budget.png" in before

    def killed(src, dst):  # the process dies between writing the new file and renaming it
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", killed)
    job(tmp_path, "b", two_methods(range(1, 2), ours=0.0), IDENTITY)  # new numbers to write
    capsys.readouterr()
    assert tables.main([str(tmp_path / "exp"), "--out", str(out)]) == 2
    assert figures.main([str(tmp_path / "exp"), "--out", str(out)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("error: cannot write") for line in errors)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old files whole, no temp left


def test_a_symlinked_destination_is_refused(tmp_path, capsys):
    job(tmp_path, "a", two_methods(range(1)), IDENTITY)
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (out / "ruler_budget0.5.md").symlink_to(target)
    assert tables.main([str(tmp_path / "exp"), "--out", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert target.read_text() == "keep me" and (out / "ruler_budget0.5.md").is_symlink()


def test_a_single_budget_still_gets_its_ranking_table(tmp_path):
    """An ablation runs one budget: how stable its order is matters as much as with several."""
    import pandas as pd

    from scripts.reports.tables import make_tables

    rows = []
    for variant, scores in (("a", [100.0, 0.0, 100.0]), ("b", [0.0, 0.0, 100.0])):
        for index, score in enumerate(scores):
            rows.append(
                dict(benchmark="ruler", task="niah_single_1", sample_id=f"s{index}", method="centroidkv",
                     variant=variant, label=variant, budget=0.25, score=score, ok=True, model="m",
                     length=4096, tpot=None, params_json="{}", method_rank=0, label_rank=0)
            )  # fmt: skip
    tables = make_tables(pd.DataFrame(rows))
    assert "ruler_ranking" in tables and "ruler_summary" not in tables
    ranking = tables["ruler_ranking"][1]
    assert list(ranking["Method"]) == ["a", "b"]


def test_a_press_under_its_default_variant_name_shows_its_label(tmp_path):
    """`{name: kvpress, params: {press: TOVAPress}}` runs as variant kvpress-TOVA (so a job can hold
    many presses) and is shown by the method's label, as everywhere else: "TOVA (kvpress)"."""
    from centroidkv.methods import method_label, method_variant

    pytest.importorskip("kvpress")
    params = {"press": "TOVAPress", "press_params": {}}
    assert method_variant("kvpress", params) == "kvpress-TOVA"
    nested = {"press": "AdaKVPress", "press_params": {"press": "SnapKVPress"}}
    assert method_variant("kvpress", nested) == "kvpress-AdaKV-SnapKV"
    job = tmp_path / "exp" / "job"
    job.mkdir(parents=True)
    base = dict(
        benchmark="ruler", task="niah_single_1", sample_id="s0", budget=0.25, status="ok", score=100.0
    )
    records = [
        {**base, "method": "kvpress", "variant": "kvpress-TOVA", "params": params},
        {**base, "method": "kvpress", "variant": "my-tova", "params": params},
    ]
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    labels = set(tables.load([tmp_path])["label"])
    assert labels == {method_label("kvpress", params), "my-tova"} and "TOVA (kvpress)" in labels
