"""An overview of a results folder: one line per job.

    python -m eval.results [DIR] [--sync-hint]

DIR (default `results`) is a results folder (`<DIR>/<experiment>/<job>/`), one experiment's folder,
or one job's folder; in a results folder, the jobs of each compact records file too
(`<DIR>/<name>.jsonl.gz`, what `make published` makes its tables and figures from), with the status
`published` and the folder of its tables (or `compact` and the file's name before `make published`). Each job shows its experiment and job name, its methods (variants) each with
the mean score of its records that succeeded at each budget (`snapkv 0.0@0.25 33.3@0.5`; the full
cache first), the parameters that set what
its numbers mean (model, benchmark, split, samples per task, budget unit), the budgets of its
compressing methods (the full cache's reference run at 1.0 is not a budget), how many records
succeeded and failed, and whether it is done, running (with the lock holder) or stopped. `--sync-hint` also prints the
`wandb sync` command of each offline W&B run found in a job folder (`<job>/wandb/offline-run-*`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.compact_store import SUFFIX, CompactError, read_compact
from eval.job_store import JobStore, _alive, _holder
from eval.records import CONFIG, DONE, LOCK, RECORDS, scan_records

COLUMNS = ("experiment", "job", "methods (mean score)", "parameters", "budgets", "ok", "failed", "status")


@dataclass
class JobSummary:
    """What the lister shows of one job folder."""

    experiment: str
    job: str
    methods: list[str]  # variants, in the order they first appear
    parameters: dict[str, Any]  # model, benchmark, split, n_samples, budget_unit (those known)
    budgets: list[float]  # of the compressing methods' records (not the full cache's 1.0)
    n_ok: int
    n_failed: int
    mean_scores: dict[str, dict[float, float]]  # variant -> budget -> mean of its ok records' scores
    status: str  # done | running (<holder>) | stopped
    offline_runs: list[Path] = field(default_factory=list)  # <job>/wandb/offline-run-*
    references: list[str] = field(default_factory=list)  # variants that do not compress (full cache)


def job_folders(root: Path) -> list[Path]:
    """Job folders under `root` (a results folder, an experiment folder or a job folder): folders
    holding a records file or a config, sorted."""
    marks = (RECORDS, CONFIG)
    if any((root / mark).is_file() for mark in marks):
        return [root]
    found = {path.parent for mark in marks for path in root.glob(f"*/{mark}")}
    found |= {path.parent for mark in marks for path in root.glob(f"*/*/{mark}")}
    return sorted(found)


def job_status(job_dir: Path) -> str:
    """done, running (with the lock holder) or stopped (neither: killed, or not started yet)."""
    if (job_dir / DONE).is_file():
        return "done"
    try:
        holder = (job_dir / LOCK).read_text(errors="replace").strip()
    except OSError:
        holder = ""
    if holder and _alive(holder):
        return f"running ({_holder(holder)})"
    return "stopped"


def summarize(job_dir: Path) -> JobSummary:
    """The summary of one job folder, from its records and the identity in its config.yaml."""
    summary = summarize_records(
        scan_records(job_dir / RECORDS).records,
        JobStore(job_dir).saved_identity() or {},
        experiment=job_dir.parent.name,
        job=job_dir.name,
        status=job_status(job_dir),
    )
    summary.offline_runs = sorted(path for path in (job_dir / "wandb").glob("offline-run-*") if path.is_dir())
    return summary


def compact_jobs(root: Path) -> list[JobSummary]:
    """The jobs of each compact records file directly in `root` (`<root>/<name>.jsonl.gz`), each with
    the status `published (<its tables folder>)` once `make published` wrote it, else `compact (<file>)`. A
    file that is not a compact records file is one line on stderr, and left out."""
    jobs = []
    for compact in sorted(root.glob(f"*{SUFFIX}")):
        try:
            header, records = read_compact(compact)
        except CompactError as error:
            print(f"[results] skipped: {error}", file=sys.stderr)
            continue
        tables = root / compact.name.removesuffix(SUFFIX) / "tables"
        # the file's name: two files may hold the same job (a study rerun on another CPU)
        status = f"published ({tables})" if tables.is_dir() else f"compact ({compact.name})"
        by_job: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            by_job.setdefault(f"{record['experiment']}/{record['job']}", []).append(record)
        for name, job_records in by_job.items():
            experiment, job = name.split("/")
            identity = header["identities"].get(name) or {}
            jobs.append(summarize_records(job_records, identity, experiment, job, status))
    return jobs


def summarize_records(
    records: list[dict[str, Any]], identity: dict[str, Any], experiment: str, job: str, status: str
) -> JobSummary:
    """The summary of one job's records and saved identity."""
    first = records[0] if records else {}
    parameters = {
        "model": identity.get("model.name", first.get("model")),
        "benchmark": identity.get("benchmark.name", first.get("benchmark")),
        "split": identity.get("benchmark.split", first.get("split")),
        "n_samples": identity.get("benchmark.n_samples"),
        "budget_unit": identity.get("budget_unit", first.get("budget_unit")),
    }
    ok = [r for r in records if r.get("status") == "ok"]
    compressing = _compressing_methods() if records else {}
    first_seen = {_variant(r): not compressing.get(str(r.get("method")), True) for r in records}
    methods = sorted(first_seen, key=lambda variant: not first_seen[variant])  # the full cache first
    scores: dict[str, dict[float, list[float]]] = {variant: {} for variant in methods}
    for r in ok:
        if isinstance(r.get("score"), (int, float)) and isinstance(r.get("budget"), (int, float)):
            scores[_variant(r)].setdefault(float(r["budget"]), []).append(float(r["score"]))
    budgets = {
        float(r["budget"])
        for r in records
        if isinstance(r.get("budget"), (int, float)) and compressing.get(str(r.get("method")), True)
    }
    if not methods:  # no record yet: the variants named in the identity (methods.<variant>.method)
        methods = list(dict.fromkeys(key.split(".")[1] for key in identity if key.startswith("methods.")))
    return JobSummary(
        experiment=experiment,
        job=job,
        methods=methods,
        parameters={key: value for key, value in parameters.items() if value is not None},
        budgets=sorted(budgets),
        n_ok=len(ok),
        n_failed=sum(r.get("status") == "failed" for r in records),
        mean_scores={
            variant: {budget: sum(s) / len(s) for budget, s in sorted(by_budget.items())}
            for variant, by_budget in scores.items()
        },
        status=status,
        references=[variant for variant in methods if first_seen.get(variant)],
    )


def _variant(record: dict[str, Any]) -> str:
    return str(record.get("variant") or record.get("method"))


def _compressing_methods() -> dict[str, bool]:
    """Registered method -> whether it compresses (the full cache does not), from the torch-free
    cached schema (`centroidkv.schema.config_schema`); a method no longer installed is absent and
    counts as compressing, so its budgets are still shown."""
    from centroidkv.schema import config_schema

    return {name: bool(spec.get("compresses", True)) for name, spec in config_schema()["methods"].items()}


def scores_cell(by_budget: dict[float, float] | None, reference: bool = False) -> str:
    """A method's means, one per budget (`33.3@0.5`); the full cache's (`reference`) without one."""
    if not by_budget:
        return "-"
    if reference:
        return " ".join(f"{mean:.1f}" for mean in by_budget.values())
    return " ".join(f"{mean:.1f}@{budget:g}" for budget, mean in by_budget.items())


def row(job: JobSummary, max_methods: int = 4) -> tuple[str, ...]:
    """The job's cells, in the order of COLUMNS; each method with its mean score per budget ("-":
    none yet)."""
    shown = ", ".join(
        f"{variant} {scores_cell(job.mean_scores.get(variant), variant in job.references)}"
        for variant in job.methods[:max_methods]
    )
    if len(job.methods) > max_methods:
        shown += f", +{len(job.methods) - max_methods}"
    return (
        job.experiment,
        job.job,
        shown or "-",
        " ".join(f"{key}={value}" for key, value in job.parameters.items()) or "-",
        ",".join(f"{b:g}" for b in job.budgets) or "-",
        str(job.n_ok),
        str(job.n_failed),
        job.status,
    )


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows aligned in columns under a header."""
    lines = [COLUMNS, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.results", description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default="results", help="a results, experiment or job folder")
    parser.add_argument("--sync-hint", action="store_true", help="print `wandb sync` for offline W&B runs")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {root} is not a folder", file=sys.stderr)
        return 2
    jobs = [summarize(job_dir) for job_dir in job_folders(root)]
    ran = {(job.experiment, job.job) for job in jobs}  # a job folder's records over its compact copy
    jobs += [job for job in compact_jobs(root) if (job.experiment, job.job) not in ran]
    jobs.sort(key=lambda job: (job.experiment, job.job))
    if not jobs:
        print(f"no jobs under {root}")
        return 0
    print(table([row(job) for job in jobs]))
    if args.sync_hint:
        runs = [run for job in jobs for run in job.offline_runs]
        print()
        if not runs:
            print("no offline W&B runs to sync")
        for run in runs:
            print(f"wandb sync {run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
