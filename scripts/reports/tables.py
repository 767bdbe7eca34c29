"""The paper's tables from any set of results, as Markdown and LaTeX.

  python scripts/tables.py results/<experiment>            # -> results/<experiment>/tables/
  python scripts/tables.py results/a results/b --out my_tables/

Tables, per benchmark the records name (their `benchmark` field), as its report asks
(`eval.benchmarks.Report`, the default when it says nothing): tasks x methods per budget with the
average, the average per budget, the ranking; then TPOT / TTFT / KV memory vs context length. No
benchmark is named here. Scores are means over the samples that ran; failed runs are left out of the
means and counted in the "failed" column. The full cache (budget 1.0) is the reference row of every
budget's table. The Markdown is also printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from centroidkv.methods import method_class, method_label, method_variant  # noqa: E402
from centroidkv.plan.measurements import table_measurements  # noqa: E402
from eval.benchmarks import benchmark_report, sample_choice_keys  # noqa: E402
from eval.dedup import drop_repeated_records  # noqa: E402
from eval.job_store import iter_records  # noqa: E402
from eval.machine_load import load_note  # noqa: E402
from eval.records import differing_keys  # noqa: E402
from scripts.reports.captions import records_words  # noqa: E402
from scripts.reports.ranking import (  # noqa: E402
    MIN_SAMPLES,
    RESOLVED,
    count_words,
    ranking_table,
    top_tier,
    unresolved_words,
)
from scripts.reports.table_files import OutputError, output_folder, output_path, safe_name, write_text  # noqa: E402
from scripts.reports.table_text import markdown_block, to_latex  # noqa: E402

# Identity keys that never split a row. Each one only says where a job's results go, or only chooses
# which samples run while every record names the sample it holds (the benchmarks' `sample_choice`:
# tasks, lengths, n_samples, ...), so a table is the same whether those samples ran in one job or in
# several. Every other identity key changes the numbers: records that differ in one are different
# configurations and get their own rows.
NON_SPLITTING_KEYS = (
    frozenset(
        {
            "results_dir",  # where the job folder is written
            "experiment_name",  # which folder groups the jobs (tables are made per experiment anyway)
        }
    )
    | sample_choice_keys()
)
# Record fields that change the numbers, for jobs whose saved identity (or missing config.yaml)
# predates them: field -> (identity key, value when the record lacks the field).
RECORD_IDENTITY_FIELDS = {"budget_unit": ("budget_unit", "entries")}
# A key absent from some identities of a label (a job of an older version): shown as "?".
ABSENT = "?"


def row_identity(record: dict[str, Any], variant: str) -> dict[str, Any]:
    """The identity keys that tell the configuration of `record` (of method variant `variant`) apart.

    From its job's saved identity (`_identity`, config.yaml): the job-wide keys but NON_SPLITTING_KEYS,
    and its own variant's keys `methods.<variant>.*` (written `method.*`, so that variants of one
    method compare key by key) but their budgets (the record has its own budget); other variants'
    keys are left out. A record without a saved identity has only its `params` (`method.params.*`).
    """
    saved = record.get("_identity")
    if not isinstance(saved, dict):
        params = record.get("params") if isinstance(record.get("params"), dict) else {}
        identity = {f"method.params.{k}": v for k, v in params.items()}
    else:
        own = f"methods.{variant}."
        identity = {}
        for key, value in saved.items():
            if key in NON_SPLITTING_KEYS or key == f"{own}budgets":
                continue
            if key.startswith("methods."):
                if not key.startswith(own):
                    continue
                key = "method." + key.removeprefix(own)
            identity[key] = value
    for field_name, (key, missing) in RECORD_IDENTITY_FIELDS.items():
        value = record.get(field_name)
        identity.setdefault(key, missing if value is None or value != value else value)
    return identity


def _own_variant(record: dict[str, Any]) -> str:
    return str(record.get("variant") or record.get("method"))


def short_key_names(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that no other key in `keys` ends with.

    `methods.x.params.r_init` -> `r_init`; `benchmark.seed` and `method.params.seed` keep `benchmark.seed`
    and `params.seed`. A bare `name` or `method` would say nothing: `model.name` stays whole.
    """
    names = {}
    for key in keys:
        parts = key.split(".")
        for size in range(1, len(parts) + 1):
            name = ".".join(parts[-size:])
            if name in ("name", "method"):
                continue
            if not any(other != key and ("." + other).endswith("." + name) for other in keys):
                break
        names[key] = name
    return names


def format_value(value: Any) -> str:
    """An identity value as a label shows it: strings bare, lists and dicts as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _natural(value: Any) -> tuple:
    """A sort key that orders numbers by value (4 < 10) and puts them before other values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, json.dumps(value, sort_keys=True, default=str))


def load(paths: list[Path]) -> pd.DataFrame:
    """All records under `paths` as a DataFrame, with a display `label` per row.

    Rows are grouped by `entry`: the record's `variant` when it has one (a named parameter set of a
    method in a multi-method job), its `method` otherwise. A variant is shown by its name; a method
    by its class's label (`Method.label`). Records of one label never pool two configurations: when
    their `row_identity` differs (a sweep over a method's parameters, or jobs with another
    max_new_tokens, model, ...), each configuration gets its own label, the label followed by the
    keys that differ in their shortest unambiguous form, e.g. "Full cache (max_new_tokens=6)". Rows
    of a method that masks entries instead of removing them (record `kv_masked`, kvpress's
    AdaKV-style presses) get " [masked]": their KV memory is the full cache's.

    `method_rank` orders entries as the records first name them (the order of the experiment's
    `methods`), the full cache first; `label_rank` orders labels the same way, the configurations of
    one entry by the values that tell them apart. Tables list rows, and figures pick styles, by it.
    """
    records = drop_repeated_records(iter_records(paths), lambda r: row_identity(r, _own_variant(r)))
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame(records)
    df["params"] = df["params"].map(lambda p: p if isinstance(p, dict) else {})
    df["params_json"] = df["params"].map(lambda p: json.dumps(p, sort_keys=True))
    variant = df["variant"] if "variant" in df else pd.Series(None, index=df.index, dtype=object)
    # The runner names every record's variant; one named as its method names an unnamed run (the method
    # itself, or e.g. kvpress-TOVA for a press) is shown by the method's label ("TOVA (kvpress)").
    variants_of = {
        (m, j): method_variant(m, p)
        for m, j, p in zip(df["method"], df["params_json"], df["params"], strict=True)
    }  # one look-up per distinct run, not per record
    default_variant = [variants_of[m, j] for m, j in zip(df["method"], df["params_json"], strict=True)]
    has_variant = (
        variant.notna()
        & (variant.astype(str) != "")
        & (variant.astype(str) != df["method"].astype(str))
        & (variant.astype(str) != pd.Series(default_variant, index=df.index))
    )
    df["entry"] = variant.where(has_variant, df["method"]).astype(str)
    df["label"] = [
        str(v) if named else method_label(m, p)
        for v, named, m, p in zip(variant, has_variant, df["method"], df["params"], strict=True)
    ]
    own_variant = variant.where(variant.notna() & (variant.astype(str) != ""), df["method"]).astype(str)
    identities = [row_identity(r, v) for r, v in zip(records, own_variant, strict=True)]
    df["identity"] = identities
    df["identity_json"] = [json.dumps(i, sort_keys=True, default=str) for i in identities]
    within_entry = _configuration_labels(df)
    df["ok"] = df["status"] == "ok"
    first_seen = {entry: rank for rank, entry in enumerate(dict.fromkeys(df["entry"]))}
    df["method_rank"] = [
        -1 if m == "full" else first_seen[e] for m, e in zip(df["method"], df["entry"], strict=True)
    ]
    labels = df.drop_duplicates("label")
    order = sorted(
        zip(labels["method_rank"], labels["label"], range(len(labels)), strict=True),
        key=lambda item: (item[0], within_entry.get(item[1], ()), item[2]),
    )
    label_rank = {label: rank for rank, (_, label, _) in enumerate(order)}
    df["label_rank"] = df["label"].map(label_rank)
    return df


def _configuration_labels(df: pd.DataFrame) -> dict[str, tuple]:
    """Give each configuration of a label its own label, in place (`load`: the label and the keys that
    tell them apart; " [masked]" for masking presses); returns label -> how it sorts among its entry's
    configurations."""
    within_entry: dict[str, tuple] = {}
    for (_, label), group in df.groupby(["experiment", "label"], sort=False):
        distinct = dict(zip(group["identity_json"], group["identity"], strict=True))
        if len(distinct) < 2:
            continue
        differing = differing_keys(list(distinct.values()))
        names = short_key_names(differing)
        for identity_json, identity in distinct.items():
            values = [identity.get(k, ABSENT) for k in differing]
            suffix = ", ".join(
                f"{names[k]}={format_value(v)}" for k, v in zip(differing, values, strict=True)
            )
            df.loc[group.index[group["identity_json"] == identity_json], "label"] = f"{label} ({suffix})"
            within_entry[f"{label} ({suffix})"] = tuple(_natural(v) for v in values)
    if "kv_masked" in df:  # head-wise masking presses keep full-size tensors: no memory saved
        masked = df["kv_masked"].map(lambda m: m is True)
        for label in df.loc[masked, "label"].unique():
            df.loc[df["label"] == label, "label"] = f"{label} [masked]"
            within_entry[f"{label} [masked]"] = within_entry.get(label, ())
    return within_entry


def kv_ratio(df: pd.DataFrame) -> pd.Series:
    """Each record's measured KV ratio over a full cache of n + max_new_tokens tokens: what the cache
    held at the end of the decode (`kv_final_ratio`: a packed store's bytes fall when its residual is
    packed, a 16-bit one's grow between compressions, so this is what two methods really held), else
    right after compression (`kv_budget_ratio`, older records), else the oldest `kv_ratio`. A method
    that does not compress (the full cache) is its own reference: 1.0, not the 0.97 of a prompt over
    prompt + max_new_tokens; a full-length cache in fewer bits (KIVI, `kv_precision`) keeps its ratio."""
    measured = pd.Series(np.nan, index=df.index, dtype=float)
    for column in ("kv_final_ratio", "kv_budget_ratio", "kv_ratio"):
        if column in df:
            measured = measured.fillna(pd.to_numeric(df[column], errors="coerce"))
    if "method" in df:
        params = df["params"] if "params" in df else pd.Series(None, index=df.index, dtype=object)
        reference = [is_reference(str(m), p) for m, p in zip(df["method"], params, strict=True)]
        measured[pd.Series(reference, index=df.index, dtype=bool)] = 1.0
    return measured


def is_reference(method: str, params: Any) -> bool:
    """Whether a run is the full-cache reference: a method that does not compress, storing its entries
    in the model's own dtype (a full-length cache in fewer bits, KIVI, is a method of its own)."""
    own_dtype = not isinstance(params, dict) or params.get("kv_precision", "model") in (None, "model")
    return own_dtype and not _compresses(method)


@functools.cache
def _compresses(method: str) -> bool:
    """Whether a registered method compresses; a method no longer installed counts as compressing."""
    try:
        return method_class(method).compresses
    except ValueError:
        return True


def score_table(df: pd.DataFrame, budget: float, names: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Methods x tasks mean score at `budget` (the full cache as reference), with Avg, the measured
    KV ratio (KV: the mean `kv_ratio` of the row's successful samples), the samples on which a method
    kept every token (`kept all`, only when there are any) and the sample counts.
    `names`: a column header per task, in column order; other tasks follow, sorted, by their names."""
    rows = df[(df["budget"] == budget) | (df["method"] == "full")]
    ok = rows[rows["ok"]]
    table = ok.pivot_table(index="label", columns="task", values="score", aggfunc="mean")
    tasks = [t for t in (names or {}) if t in table.columns] + sorted(
        t for t in table.columns if t not in (names or {})
    )
    table = table[tasks]
    table["Avg"] = table.mean(axis=1, skipna=False)
    table["KV"] = kv_ratio(ok).groupby(ok["label"]).mean()
    kept_all = ok["kept_every_token"].eq(True) if "kept_every_token" in ok else None  # None: full cache
    if kept_all is not None and kept_all.any():
        # samples on which the budget exceeded what the method could spend: R bought no compression
        table["kept all"] = kept_all.groupby(ok["label"]).sum().reindex(table.index).fillna(0).astype(int)
    table["n"] = ok.groupby("label").size()
    table["failed"] = rows[~rows["ok"]].groupby("label").size().reindex(table.index).fillna(0).astype(int)
    order = rows.drop_duplicates("label").sort_values("label_rank")["label"]
    table = table.reindex([label for label in order if label in table.index])
    table.columns = [(names or {}).get(c, c) for c in table.columns]
    table.index.name = "Method"
    return table


def with_measurement_columns(ok: pd.DataFrame) -> list[str]:
    """Add one column per table measurement (`centroidkv.plan.measurements`) the records hold, named by its
    title and scaled (TPOT in ms, KV in MiB); returns the titles, in registration order."""
    titles = []
    for measurement in table_measurements():
        if measurement.name in ok and ok[measurement.name].notna().any():
            ok[measurement.title] = pd.to_numeric(ok[measurement.name], errors="coerce") * measurement.scale
            titles.append(measurement.title)
    return titles


def _who(ok: pd.DataFrame) -> pd.Series:
    return ok.apply(
        lambda r: r["label"] if r["method"] == "full" else f"{r['label']} @ {r['budget']:g}", axis=1
    )


def _in_method_order(table: pd.DataFrame, ok: pd.DataFrame) -> pd.DataFrame:
    order = ok.drop_duplicates("who").sort_values(["label_rank", "budget"])["who"]
    table = table.reindex(list(order))
    table.index.name = "Method"
    return table


def speed_table(df: pd.DataFrame) -> pd.DataFrame:
    """Method@budget x context length: the mean of every table measurement (TPOT ms, TTFT s, KV MiB...)."""
    ok = df[df["ok"]].copy()
    ok["who"] = _who(ok)
    parts = []
    for title in with_measurement_columns(ok):
        part = ok.pivot_table(index="who", columns="length", values=title, aggfunc="mean")
        part.columns = [f"{title} @ {int(c)}" for c in part.columns]
        parts.append(part)
    return _in_method_order(pd.concat(parts, axis=1), ok)


def measurements_table(df: pd.DataFrame) -> pd.DataFrame | None:
    """Method@budget: the mean of every table measurement over the successful records (None without any)."""
    ok = df[df["ok"]].copy()
    ok["who"] = _who(ok)
    titles = with_measurement_columns(ok)
    if ok.empty or not titles:
        return None
    table = ok.groupby("who")[titles].mean()
    return _in_method_order(table, ok)


def load_or_error(paths: list[Path]) -> pd.DataFrame | str:
    """The records under `paths`, or a one-line error when a path is missing or holds none."""
    missing = [p for p in paths if not p.exists()]
    if missing:
        return f"error: no such results: {', '.join(map(str, missing))}"
    df = load(paths)
    return df if not df.empty else f"error: no records under {', '.join(map(str, paths))}"


def budget_words(df: pd.DataFrame) -> str:
    """ " in bytes" / " in entries" for a caption when the records say their budget unit, else ""."""
    if "budget_unit" not in df or df["budget_unit"].isna().all():
        return ""
    units = sorted(df["budget_unit"].fillna("entries").astype(str).unique())  # missing: older = entries
    return f" in {' and '.join(units)}"


def split_words(df: pd.DataFrame) -> str:
    """ ", test split" for a caption when the records say their split (dev / test), else ""."""
    if "split" not in df or df["split"].isna().all():
        return ""
    splits = sorted(df["split"].dropna().astype(str).unique())
    unknown = " and records without a split" if df["split"].isna().any() else ""
    return f", {' and '.join(splits)} split{'s' if len(splits) > 1 else ''}{unknown}"


# A comparison without the full cache says so: its scores have no reference beside them.
MISSING_REFERENCE = (
    ". Warning: no full-cache reference in these records (add full to methods=[...], or run it once "
    "in this experiment)"
)


def _ranking(
    part: pd.DataFrame, budgets: list[float], what: str, models: str, lengths: str
) -> tuple[str, pd.DataFrame, int]:
    """The ranking table of one benchmark's records and its caption, which warns about budgets with too
    few samples to resolve their order."""
    caption = (
        f"{what} by average score with 95 % bootstrap intervals (paired over samples), "
        f"{models}, context {lengths} tokens{records_words(part)}; resolved: whether a row's lead over the next one "
        f"would survive new samples (P(> next) >= {RESOLVED:g} and at least {MIN_SAMPLES} samples)"
    )
    ranking = ranking_table(part, budgets)
    few = sorted(
        {f"{b}" for b, n in zip(ranking.index, ranking.get("samples", []), strict=True) if n < MIN_SAMPLES}
    )
    if few:
        caption += (
            f". Warning: fewer than {MIN_SAMPLES} samples per method at budget {', '.join(few)}: "
            "that order is not resolved"
        )
    return caption, ranking, 1


def make_tables(df: pd.DataFrame) -> dict[str, tuple[str, pd.DataFrame, int]]:
    """name -> (caption, table, digits) for every table the records allow: per benchmark, those its
    report asks for (`eval.benchmarks.benchmark_report`), then the speed table."""
    tables: dict[str, tuple[str, pd.DataFrame, int]] = {}
    for bench in sorted(df["benchmark"].dropna().unique()):
        part = df[df["benchmark"] == bench]
        report = benchmark_report(bench)
        names, title = report.task_labels, report.title
        models = ", ".join(sorted(part["model"].dropna().unique()))
        lengths = context_lengths(part)
        budgets = sorted(b for b in part.loc[part["method"] != "full", "budget"].unique())
        averages = {}
        for budget in budgets or [1.0]:
            caption = (
                f"{title} scores (0-100) at budget {budget:g}{budget_words(part)}, {models}, "
                f"context {lengths} tokens{split_words(part)}; KV: measured KV ratio"
            )
            table = score_table(part, budget, names)
            n_least = int(table["n"].min()) if table["n"].notna().any() else 0  # per row: the fewest samples
            warning = unresolved_words(n_least) if budgets else ""
            caption += records_words(part[(part["budget"] == budget) | (part["method"] == "full")])
            caption += f". Warning: {warning}" if warning else ""
            caption += MISSING_REFERENCE if budgets and not (part["method"] == "full").any() else ""
            tier = top_tier(part, budget) if budgets else set()
            table.attrs["bold"] = {"Avg": tier}
            tables[f"{safe_name(bench)}_budget{budget:g}"] = (caption, table, 1)
            averages[f"{budget * 100:g}%"] = (table["Avg"], tier, n_least)
        if report.summary and len(averages) > 1:
            summary = pd.DataFrame({column: avg for column, (avg, _, _) in averages.items()})
            summary.attrs["bold"] = {column: tier for column, (_, tier, _) in averages.items()}
            summary.index.name = "Method"
            n_tasks = count_words(part["task"].nunique(), "task")
            caption = f"{title} average over {n_tasks} per budget, {models}, context {lengths} tokens"
            caption += records_words(part)
            warning = unresolved_words(min(n for _, _, n in averages.values()))
            caption += f". Warning: {warning}" if warning else ""
            tables[f"{safe_name(bench)}_summary"] = (caption, summary, 1)
        if report.ranking and budgets:  # how stable the order is, at every budget (one included)
            tables[f"{safe_name(bench)}_ranking"] = _ranking(
                part, budgets, f"{title} ranking", models, lengths
            )
    measured = measurements_table(df)
    if measured is not None:
        models = ", ".join(sorted(df["model"].dropna().unique()))
        caption = f"Mean of each measurement per record, {models}, context {context_lengths(df)} tokens"
        caption += records_words(df) + load_note(df.to_dict("records"))
        tables["measurements"] = (caption, measured, 2)
    timed = df[df["tpot"].notna()] if "tpot" in df else df.iloc[0:0]
    if not timed.empty and timed["length"].nunique() > 1:
        models = ", ".join(sorted(timed["model"].dropna().unique()))
        tables["speed"] = (
            f"Decoding time per token, time to first token and KV cache size, {models}"
            + records_words(timed)
            + load_note(timed.to_dict("records")),
            speed_table(timed),
            2,
        )
    return tables


def context_lengths(part: pd.DataFrame) -> str:
    """The context lengths of `part`, as a caption names them ("4096, 8192")."""
    return ", ".join(str(int(x)) for x in sorted(part["length"].dropna().unique()))


def write_tables(df: pd.DataFrame, out: Path, echo: bool = False) -> list[Path]:
    """Tables per experiment (file names prefixed by the experiment, `safe_name`, when there are
    several), each written directly in `out`, never through a link (`output_path`); `echo`: each
    table's Markdown printed too."""
    output_folder(out)
    written = []
    several = df["experiment"].nunique() > 1
    for experiment, part in df.groupby("experiment"):
        written += _write(part, out, f"{safe_name(experiment)}_" if several else "", echo)
    return written


def _write(df: pd.DataFrame, out: Path, prefix: str, echo: bool) -> list[Path]:
    written = []
    for name, (caption, table, digits) in make_tables(df).items():
        name = prefix + name
        bold_best = not name.endswith(("speed", "ranking", "measurements"))
        markdown = markdown_block(caption, table, digits, bold_best)
        latex = to_latex(table, caption, digits, bold_best) + "\n"
        for suffix, text in ((".md", markdown), (".tex", latex)):
            path = output_path(out, f"{name}{suffix}")
            write_text(path, text)
            written.append(path)
        if echo:
            print(markdown)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="experiment/job folders or records.jsonl files")
    parser.add_argument("--out", type=Path, help="output folder (default: <first path>/tables)")
    args = parser.parse_args(argv)
    df = load_or_error(args.paths)
    if isinstance(df, str):
        print(df, file=sys.stderr)
        return 2
    out = args.out or (args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent) / "tables"
    try:
        written = write_tables(df, out, echo=True)
    except OutputError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"[tables] {len(written)} files under {out}")
    return 0
