"""Figures (issue 28, item 5): written next to the results they draw unless --out says otherwise; one
colour and marker per method, from the method registry, the same in every figure; every drawn series
in the legend (the full cache's star too); points at equal coordinates visible; every title names the
benchmark by its report ("RULER: ..."). Records are written by hand into a temporary results folder;
`_save` is replaced where the test only looks at the drawn figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba

from scripts.reports import figure_styles, figures, tables


def record(experiment: str, method: str, budget: float, task: str, sample: int, score: float, **extra):
    return {"benchmark": "ruler", "task": task, "length": 1024, "sample_id": f"{task}-{sample}",
            "method": method, "variant": extra.pop("variant", method), "params": extra.pop("params", {}),
            "budget": budget, "status": "ok", "score": score, "model": "smollm2-135m",
            "experiment": experiment, "kv_budget_ratio": extra.pop("ratio", budget), **extra}  # fmt: skip


def write_job(root: Path, experiment: str, records: list[dict[str, Any]]) -> Path:
    folder = root / experiment / "job"
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder.parent


def three_methods(experiment: str, order: tuple[str, ...], snapkv: float = 50.0) -> list[dict[str, Any]]:
    """The methods of `order` (full at 1.0, the others at 0.25 and 0.5) on two tasks, in that order;
    CentroidKV scores 100 and SnapKV `snapkv`, so at budget 0.5 both may hit one point."""
    scores = {"full": 100.0, "centroidkv": 100.0, "snapkv": snapkv, "h2o": 20.0}
    return [
        record(experiment, method, budget, task, 0, scores[method])
        for method in order
        for budget in ((1.0,) if method == "full" else (0.25, 0.5))
        for task in ("niah_single_1", "vt")
    ]


@pytest.fixture
def drawn(monkeypatch):
    """The figures `_save` was given, by name (nothing is written)."""
    saved: dict[str, Any] = {}
    monkeypatch.setattr(figures, "_save", lambda fig, out, name: saved.setdefault(name, fig) and [out / name])
    yield saved
    plt.close("all")


def series(ax) -> dict[str, Any]:
    """The labelled lines of an axes, by label."""
    return {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}


def test_a_method_keeps_its_colour_and_marker_from_the_registry_in_every_experiment(tmp_path, drawn):
    """Before: the style followed the label's rank in the records, so CentroidKV was orange beside
    the full cache and blue in an experiment without it."""
    write_job(tmp_path, "with_full", three_methods("with_full", ("full", "centroidkv", "snapkv")))
    write_job(tmp_path, "without_full", three_methods("without_full", ("snapkv", "h2o", "centroidkv")))
    figures.make_figures(tables.load([tmp_path]), tmp_path / "out")
    for name in ("accuracy_vs_budget", "score_vs_kv"):
        a = series(drawn[f"with_full_ruler_{name}"].axes[0])
        b = series(drawn[f"without_full_ruler_{name}"].axes[0])
        for label, method in (("CentroidKV", "centroidkv"), ("SnapKV", "snapkv")):
            expected = figure_styles.method_style(method)
            for line in (a[label], b[label]):
                assert to_rgba(line.get_color()) == to_rgba(expected["color"]), (name, label)
                assert line.get_marker() == expected["marker"], (name, label)
    # Every registered method that compresses has its own pair.
    pairs = {tuple(figure_styles.method_style(m).values()) for m in compressing_methods()}
    assert len(pairs) == len(compressing_methods()) >= 9
    assert figure_styles.method_style("full")["marker"] == "*"


def test_variants_of_one_method_share_its_colour_and_marker_and_differ_in_line_and_fill(tmp_path, drawn):
    records = [record("exp", "full", 1.0, "vt", 0, 100.0)] + [
        record("exp", "centroidkv", 0.5, "vt", 0, score, variant=v, params={"r_init": r})
        for v, r, score in (("ckv_a", 0.1, 50.0), ("ckv_b", 0.3, 70.0))
    ]
    write_job(tmp_path, "exp", records)
    styles = figure_styles.label_styles(tables.load([tmp_path / "exp"]))
    a, b = styles["ckv_a"], styles["ckv_b"]
    assert (
        (a["color"], a["marker"])
        == (b["color"], b["marker"])
        == tuple(figure_styles.method_style("centroidkv").values())
    )
    assert a["linestyle"] != b["linestyle"] and a["fillstyle"] != b["fillstyle"]


def test_the_full_cache_star_is_in_the_legend_and_equal_points_stay_visible(tmp_path, drawn):
    """Before: the star had no legend entry, and SnapKV at 100 drew over CentroidKV at 100 (same
    measured ratio) so that only one of them could be seen."""
    write_job(tmp_path, "exp", three_methods("exp", ("full", "centroidkv", "snapkv"), snapkv=100.0))
    figures.make_figures(tables.load([tmp_path / "exp"]), tmp_path / "out")
    ax = drawn["exp_ruler_score_vs_kv"].axes[0]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    drawn_series = [
        line for line in ax.lines if len(line.get_xdata()) and line.get_marker() not in ("None", "")
    ]
    assert sorted(legend) == sorted(line.get_label() for line in drawn_series)  # every series, no other
    star = series(ax)["Full cache (no compression)"]
    assert star.get_marker() == "*" and list(star.get_ydata()) == [100.0]
    lines = series(ax)
    ours, theirs = (
        list(zip(lines[m].get_xdata(), lines[m].get_ydata(), strict=True)) for m in ("CentroidKV", "SnapKV")
    )
    assert not set(ours) & set(theirs)  # no point of one hides a point of the other
    assert abs(ours[1][0] - 0.5) < 0.02 and abs(theirs[1][0] - 0.5) < 0.02  # near their true ratio
    notes = [text.get_text() for text in ax.texts]
    assert any("spread" in note and "along x" in note for note in notes)  # the figure says so


def test_every_title_names_the_benchmark_by_its_report(tmp_path, drawn):
    """Before: "ruler: average score vs measured KV ratio" beside "RULER average score vs KV budget"."""
    records = three_methods("exp", ("full", "centroidkv", "snapkv"))
    records += [
        record("exp", "centroidkv", 0.5, task, 0, 60.0, variant="ckv_r", params={"r_init": 0.2})
        for task in ("niah_single_1", "vt")
    ]
    write_job(tmp_path, "exp", records)
    figures.make_figures(tables.load([tmp_path / "exp"]), tmp_path / "out")
    assert {"exp_ruler_accuracy_vs_budget", "exp_ruler_score_vs_kv"} <= set(drawn)
    for name, fig in drawn.items():
        title = fig._suptitle.get_text() if fig._suptitle is not None else fig.axes[0].get_title()
        assert title.startswith("RULER: "), (name, title)


def test_figures_go_next_to_their_results_unless_out_is_given(tmp_path, monkeypatch, capsys):
    """Before: every figure went into the repository's paper_figures/, whatever results it drew."""
    repository = tmp_path / "repository"
    monkeypatch.setattr(figures, "ROOT", repository)
    results = tmp_path / "results"
    write_job(results, "exp_a", three_methods("exp_a", ("full", "centroidkv")))
    write_job(results, "exp_b", three_methods("exp_b", ("full", "snapkv")))
    assert figures.main([str(results)]) == 0
    assert (results / "exp_a" / "figures" / "exp_a_ruler_score_vs_kv.png").is_file()
    assert (results / "exp_b" / "figures" / "exp_b_ruler_accuracy_vs_budget.pdf").is_file()
    assert not any((results / "exp_a" / "figures").glob("exp_b_*"))
    assert not repository.exists()
    assert figures.main([str(results / "exp_a" / "job" / "records.jsonl")]) == 0  # a file: its experiment's
    assert figures.main([str(results / "exp_a"), "--out", str(tmp_path / "paper_figures")]) == 0
    assert (tmp_path / "paper_figures" / "exp_a_ruler_score_vs_kv.png").is_file()
    capsys.readouterr()


def compressing_methods() -> list[str]:
    from centroidkv.methods import method_class, method_names

    return [name for name in method_names() if method_class(name).compresses]


def test_adding_a_method_moves_no_other_methods_colour_or_marker(monkeypatch):
    """Issue 40, item 3. Before: the pair was the place among the sorted registered names, so adding
    `keynorm` turned SnapKV from an olive pentagon into a cyan plus."""
    from centroidkv.methods import REGISTRY, method_class

    before = {name: figure_styles.method_style(name) for name in compressing_methods()}
    for new_name in ("aaa_first", "keynorm", "mmm_middle"):
        added = type(f"Added_{new_name}", (method_class("snapkv"),), {"name": new_name})
        monkeypatch.setitem(REGISTRY, new_name, added)
        assert new_name in compressing_methods()
        after = {name: figure_styles.method_style(name) for name in before}
        assert after == before, new_name


def test_a_full_length_cache_in_fewer_bits_is_drawn_as_a_method_of_its_own(tmp_path, drawn):
    """KIVI (no eviction, 2-bit codes) used to get the full cache's reference style, and the
    score-vs-budget figure then failed (two line widths); it is a method with its own colour."""
    records = [
        record("exp", method, 1.0, task, 0, 100.0 if method == "full" else 40.0, params=params, ratio=ratio)
        for method, params, ratio in (("full", {}, 1.0), ("kivi", {"kv_precision": "int2"}, 0.21))
        for task in ("niah_single_1", "vt")
    ]
    figures.make_figures(tables.load([write_job(tmp_path, "exp", records)]), tmp_path / "out")
    lines = series(drawn["exp_ruler_accuracy_vs_budget"].axes[0])
    kivi = next(line for label, line in lines.items() if label.startswith("KIVI"))
    assert kivi.get_marker() != figure_styles.FULL_MARKER and kivi.get_linestyle() == "-"
    assert figure_styles.method_style("kivi", {"kv_precision": "int2"})["marker"] != figure_styles.FULL_MARKER


def test_the_compared_methods_get_nine_hues_and_nine_markers():
    """A strong tab20 colour and its light twin read as one hue: CentroidKV (brown) and DuoAttention
    (light brown) looked alike, as did H2O and K-Means (orange, light orange)."""
    tab20 = [to_rgba(colour) for colour in plt.get_cmap("tab20").colors]
    runs = [
        ("kivi", {"kv_precision": "int2"}) if key == "kivi-int2" else (key, {})
        for key in figure_styles.COMPARED_METHODS
    ]
    styles = {name: figure_styles.method_style(name, params) for name, params in runs}
    places = {name: tab20.index(to_rgba(style["color"])) for name, style in styles.items()}
    assert len({place // 2 for place in places.values()}) == len(runs), places
    assert len({style["marker"] for style in styles.values()}) == len(runs), styles
    assert places["centroidkv"] % 2 == 0  # a strong colour for the method of the paper
