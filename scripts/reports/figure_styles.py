"""Every figure's colours and markers: one colour and marker per method, from its name alone.

`method_style` gives a method (or a wrapped variant) its pair of `PAIRS` at a stable hash of its name,
so adding or removing a method moves no other; the variants or configurations of one method share its
pair and differ in line style and marker fill (`series_look`); the full cache is black with a star;
in the score-vs-KV figure the marker can name the storage precision instead (`PRECISION_MARKERS`),
and points that would hide each other are spread a little along x (`spread_coinciding`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import matplotlib
import pandas as pd

from centroidkv.methods import method_class, method_variant
from scripts.reports.tables import is_reference

MARKERS = "osv^D<>pPXh"  # "*" is the full cache's
# tab20's strong colours, then their light ones, without its greys (the full cache's): 9 hues.
COLORS = [matplotlib.colormaps["tab20"](i) for i in (*range(0, 20, 2), *range(1, 20, 2)) if i not in (14, 15)]
# (colour, marker) pairs: both change from one to the next, all distinct (lcm(18, 11) = 198).
PAIRS = [(COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]) for i in range(len(COLORS) * len(MARKERS))]
FULL_COLORS = ("black", "dimgray", "darkgray")  # full-cache references (several when a row split)
FULL_MARKER = "*"
STYLE_SALT = "centroidkv-style:178796:"  # see style_place
# The style keys (`method_variant`) of the paper's comparison, KIVI as KIVI-2: nine hues and nine
# markers for nine methods (a strong colour and its light twin read as one hue).
COMPARED_METHODS = (
    "centroidkv",
    "streaming_llm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "cam",
    "kmeans",
    "duo_attention",
    "kivi-int2",
)
# How the series of one method differ (its variants, configurations or budgets): the i-th one gets
# the i-th line style and marker fill, so that even a single point tells them apart.
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
FILLSTYLES = ("full", "none", "left", "bottom", "right", "top")


@functools.cache
def style_place(name: str) -> int:
    """A method's (or wrapped variant's) place in PAIRS: a stable function of its name alone (a salted
    SHA-1), so that registering or removing another method never moves it. The salt is one that gives
    `COMPARED_METHODS` nine different hues and markers and CentroidKV a strong colour; another method
    (a kvpress press) may share a hue or a pair with one of them (a pair: 1 in 198), and the legend
    names each."""
    return int(hashlib.sha1((STYLE_SALT + name).encode()).hexdigest(), 16) % len(PAIRS)


def method_style(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The colour and marker of a method run, the same in every figure: the pair at `style_place` of
    the registered name, or of what a wrapper names (`Method.variant_for`, e.g. kvpress-TOVA for
    kvpress's TOVAPress). The full cache is black with a star; a full-length cache in fewer bits
    (KIVI) is a method of its own.

    The one place a series' colour and marker are chosen: a field that should change the marker
    (e.g. a KV precision) belongs here."""
    cls = _registered(method)
    if is_reference(method, params):
        return dict(color=FULL_COLORS[0], marker=FULL_MARKER)
    key = method_variant(method, params) if cls is not None else method
    return dict(zip(("color", "marker"), PAIRS[style_place(key)], strict=True))


def _registered(method: str):
    try:
        return method_class(method)
    except ValueError:  # records of a method that is no longer installed
        return None


def series_look(index: int) -> dict[str, Any]:
    """Line style and marker fill of the `index`-th series of one method (0: solid line, filled)."""
    return dict(linestyle=LINESTYLES[index % len(LINESTYLES)], fillstyle=FILLSTYLES[index % len(FILLSTYLES)])


def series_styles(series: list[tuple[Any, str, dict[str, Any]]]) -> dict[Any, dict[str, Any]]:
    """Each series -> its style: its method's colour and marker (`method_style`) and, among the
    series of one method in the order given, the i-th `series_look`. A full-cache series gets the
    reference style (`full_style`, the i-th of them) with the full cache's star.

    `series`: (series name, method, params) in drawing order, each name once."""
    styles: dict[Any, dict[str, Any]] = {}
    seen: dict[tuple, int] = {}
    n_full = 0
    for name, method, params in series:
        style = method_style(method, params)
        if style["marker"] == FULL_MARKER:
            styles[name] = {**full_style(n_full), "marker": FULL_MARKER}
            n_full += 1
            continue
        key = (style["color"], style["marker"])
        styles[name] = {**style, **series_look(seen.get(key, 0))}
        seen[key] = seen.get(key, 0) + 1
    return styles


def label_styles(df: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """label -> its style (`series_styles`), the labels of one method (its variants, configurations)
    numbered in `label_rank` order."""
    firsts = df.sort_values("label_rank").drop_duplicates("label")
    return series_styles(list(zip(firsts["label"], firsts["method"], firsts["params"], strict=True)))


def full_style(index: int) -> dict:
    """A full-cache reference line: dashed, black first, greys for further configurations."""
    return dict(color=FULL_COLORS[index % len(FULL_COLORS)], linestyle="--", linewidth=1.2)


# Storage precision -> marker in the score-vs-KV figure (centroidkv.cache.quantization.PRECISIONS).
PRECISION_MARKERS = {"model": "o", "bf16": "D", "fp16": "d", "int8": "s", "int4": "^", "int2": "v"}


def label_precision(label: str) -> str:
    """The storage precision a run's label names (" @int8", `precision_suffix`); "model" without one."""
    suffix = label.rpartition(" @")[2] if " @" in label else "model"
    return suffix if suffix in PRECISION_MARKERS else "model"


def spread_coinciding(
    points: list[tuple[str, float, float]], step: float, y_close: float = 1.5
) -> dict[tuple[str, int], float]:
    """Small deterministic offsets along x for points that would hide each other.

    `points`: (series, x, y) in drawing order. A point closer than `step` in x and `y_close` in y to
    the first point of a group joins that group; the points of a group are spread `step` apart
    around their own x, in drawing order; a lone point keeps its x. Returns (series, index of the
    point in its series) -> offset."""
    groups: list[tuple[float, float, list[tuple[str, int]]]] = []
    index_in: dict[str, int] = {}
    for series, x, y in points:
        index = index_in.get(series, 0)
        index_in[series] = index + 1
        group = next((g for g in groups if abs(g[0] - x) < step and abs(g[1] - y) < y_close), None)
        if group is None:
            groups.append((x, y, [(series, index)]))
        else:
            group[2].append((series, index))
    offsets = {}
    for _, _, members in groups:
        for position, member in enumerate(members):
            offsets[member] = (position - (len(members) - 1) / 2) * step
    return offsets
