"""What every table caption and figure title says about the records behind it, written by the code
rather than by hand: the samples behind each cell and the head policy of each method."""

from __future__ import annotations

import pandas as pd


def _count_range(counts: pd.Series) -> str:
    fewest, most = int(counts.min()), int(counts.max())
    return f"{fewest}" if fewest == most else f"{fewest}-{most}"


def samples_per_cell(part: pd.DataFrame) -> str:
    """The successful records behind each cell of `part`'s tables: "5 samples per cell" for one task,
    "5 samples per task cell, 25 per average" (or ranges, "3-5") for several."""
    ok = part[part["ok"]]
    if ok.empty:
        return "no successful samples"
    per_task = _count_range(ok.groupby(["label", "task", "budget"]).size())
    plural = "" if per_task == "1" else "s"
    if ok["task"].nunique() < 2:
        return f"{per_task} sample{plural} per cell"
    per_average = _count_range(ok.groupby(["label", "budget"]).size())
    return f"{per_task} sample{plural} per task cell, {per_average} per average"


def _policy(params: object) -> str:
    heads = params.get("heads") if isinstance(params, dict) else None
    return str(heads) if heads is not None else "no head policy"


def head_policies(part: pd.DataFrame) -> str:
    """The head policy (`heads`: none | whole | budget) of each method in `part`: "head policy: none
    for every method", or the rarer policies with their methods and the most common one for the
    others ("head policy: whole for CentroidKV, DuoAttention; none for the others")."""
    ordered = part.sort_values("label_rank", kind="stable") if "label_rank" in part else part
    by_policy: dict[str, list[str]] = {}
    params_of = ordered["params"] if "params" in ordered else [None] * len(ordered)
    for label, params in zip(ordered["label"], params_of, strict=True):
        methods = by_policy.setdefault(_policy(params), [])
        if label not in methods and not any(label in others for others in by_policy.values()):
            methods.append(str(label))
    if not by_policy:
        return "head policy: none given"
    common = max(by_policy, key=lambda policy: len(by_policy[policy]))
    if len(by_policy) == 1:
        return f"head policy: {common} for every method"
    rarer = [f"{policy} for {', '.join(labels)}" for policy, labels in by_policy.items() if policy != common]
    return f"head policy: {'; '.join(rarer)}; {common} for the others"


def records_words(part: pd.DataFrame) -> str:
    """ "; 5 samples per cell; head policy: ...": what a caption adds about the records behind it."""
    return f"; {samples_per_cell(part)}; {head_policies(part)}"
