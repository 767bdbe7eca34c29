"""Compact records: the fields the tables need, gzipped, with the commit and command that made them,
so that a reader can regenerate every table without rerunning anything.

  python scripts/compact_records.py export results/<experiment> --command "make reproduce-ruler"
      -> results/<experiment>.jsonl.gz (the default --out; a few KB per 100 records)
  python scripts/compact_records.py tables results/*.jsonl.gz [--out DIR] [--no-figures]
      -> the tables of `scripts/tables.py` from each compact file alone (default: results/<experiment>/tables/,
         so `rm -rf results/*/` removes every generated file and keeps the compact records), and the
         figures of `scripts/figures.py` beside them (results/<experiment>/figures/)

The file's first line is {"compact": 1, "commit", "command", "identities": {experiment/job: the
job's saved identity}, "cpus": the CPUs the jobs ran on (absent in files exported before env.json
named them)}; each further line is one record with only COMPACT_FIELDS. `tables` expands it into job
folders in a temporary directory and runs the same `write_tables` as `scripts/tables.py`.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from centroidkv.plan.measurements import table_measurements  # noqa: E402
from eval.compact_store import FORMAT_VERSION, SUFFIX, read_compact  # noqa: E402
from eval.job_store import EARLIER_ENV, iter_records  # noqa: E402
from eval.records import CONFIG, KEY_FIELDS, RECORDS  # noqa: E402

# What tables and figures read besides the record key and the table measurements.
TABLE_FIELDS = ("status", "score", "model", "experiment", "job", "kv_budget_ratio", "kv_final_ratio",
                "kept_every_token", "kv_allocated_ratio", "kv_ratio", "kv_masked", "split", "budget_unit",
                "protocol", "context_length", "depth", "prefill_shared", "decode_batch", "load_1min", "n_cores",
                "wrong_answer")  # fmt: skip
COMPACT_FIELDS = tuple(dict.fromkeys((*KEY_FIELDS, *TABLE_FIELDS, *(m.name for m in table_measurements()))))


def _commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def _env_values(paths: list[Path], key: str) -> set[str]:
    """The values of `key` in the env.json of the jobs under `paths`, their earlier runs' included
    (`eval.job_store.EARLIER_ENV`)."""
    found = set()
    for path in paths:
        for env_file in sorted(path.rglob("env.json")) if path.is_dir() else []:
            env = json.loads(env_file.read_text())
            found.update([env.get(key), *env.get(EARLIER_ENV[key], [])])
    found.discard(None)
    return found


def _run_commit(paths: list[Path]) -> str | None:
    """The commit the jobs under `paths` ran on (their env.json, with the commits of earlier runs of
    a resumed job), else this checkout's: records exported later, from another checkout, still name
    the code that made them."""
    found = _env_values(paths, "git_commit")
    if len(found) > 1:
        raise ValueError(
            f"the jobs ran on {len(found)} commits ({', '.join(sorted(found))}): export them apart, or name"
            " the commit whose code made every record with --commit"
        )
    return found.pop() if found else _commit()


def export(paths: list[Path], out: Path, command: str, commit: str | None = None) -> int:
    """Write the compact file of the records under `paths`; returns the number of records. `commit`:
    the code that made them, when their jobs ran on several commits (a job resumed on a later one
    whose code is the same)."""
    identities: dict[str, Any] = {}
    lines = []
    for record in iter_records(paths):
        job = f"{record['experiment']}/{record['job']}"
        identities.setdefault(job, record.get("_identity"))
        lines.append(json.dumps({k: record[k] for k in COMPACT_FIELDS if k in record}, sort_keys=True))
    header = {
        "compact": FORMAT_VERSION,
        "commit": commit or _run_commit(paths),
        "command": command,
        "identities": identities,
    }
    cpus = sorted(_env_values(paths, "cpu"))
    if cpus:  # jobs run before env.json named the CPU name none
        header["cpus"] = cpus
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as handle:  # mtime 0: the same bytes again
        handle.write(("\n".join([json.dumps(header, sort_keys=True), *lines]) + "\n").encode())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buffer.getvalue())
    return len(lines)


def expand(compact: Path, folder: Path) -> list[Path]:
    """The compact file as job folders under `folder` (<experiment>/<job>/records.jsonl + config.yaml
    with the job's identity); returns the job folders. Every line is checked before anything is
    written (`eval.compact_store.read_compact`: a record never names a folder outside `folder`);
    CompactError, a ValueError of one line, for a file not made by `export`."""
    header, records = read_compact(compact)
    by_job: dict[str, list[str]] = {}
    for record in records:
        by_job.setdefault(f"{record['experiment']}/{record['job']}", []).append(json.dumps(record) + "\n")
    for job, lines in by_job.items():
        job_dir = folder / job
        job_dir.mkdir(parents=True)
        (job_dir / RECORDS).write_text("".join(lines))
        identity = header["identities"].get(job)
        if identity is not None:
            (job_dir / CONFIG).write_text(yaml.safe_dump({"identity": identity}, sort_keys=False))
    return [folder / job for job in by_job]


def default_tables_folder(compact: Path) -> Path:
    """results/<experiment>.jsonl.gz -> results/<experiment>/tables (the folder `scripts/tables.py` uses)."""
    name = compact.name.removesuffix(SUFFIX) if compact.name.endswith(SUFFIX) else compact.stem
    return compact.parent / name / "tables"


def tables_from_compact(compact: Path, out: Path, figures: bool = True) -> list[Path]:
    """The tables of `scripts/tables.py` from the compact file alone, and (`figures`) the figures of
    `scripts/figures.py` in the `figures` folder beside them."""
    from scripts.reports.tables import load_or_error, write_tables

    with tempfile.TemporaryDirectory() as temporary:
        expand(compact, Path(temporary))
        df = load_or_error([Path(temporary)])
        if isinstance(df, str):
            raise ValueError(df)
        from scripts.wrong_answers import write_counts

        written = write_tables(df, out) + write_counts(df, out)  # the confusion counts of multikey tasks
        if figures:
            from scripts.reports.figures import make_figures

            written += make_figures(df, out.parent / "figures")
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="action", required=True)
    exporting = commands.add_parser("export", help="records under a folder -> a compact file")
    exporting.add_argument("path", type=Path)
    exporting.add_argument(
        "--out", type=Path, help="default: <path>.jsonl.gz, beside the experiment's folder"
    )
    exporting.add_argument("--command", required=True, help="the command that produced the records")
    exporting.add_argument("--commit", help="the commit whose code made every record (a resumed job's)")
    tabling = commands.add_parser("tables", help="compact files -> their tables")
    tabling.add_argument("compact", type=Path, nargs="+")
    tabling.add_argument(
        "--out", type=Path, help="one file's tables here (default: <experiment>/tables beside it)"
    )
    tabling.add_argument("--no-figures", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    try:
        if args.action == "export":
            out = args.out or args.path.parent / f"{args.path.name}{SUFFIX}"
            print(f"[compact] {export([args.path], out, args.command, args.commit)} records -> {out}")
        elif args.out and len(args.compact) > 1:
            raise ValueError("--out takes one compact file's tables; give one file or no --out")
        else:
            publish(args.compact, args.out, figures=not args.no_figures)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def publish(compacts: list[Path], out: Path | None, figures: bool) -> None:
    """The tables (and figures) of every compact file: each file checked first, so that a bad one
    stops the command before anything is written; one line per table and figure written, then the
    count."""
    for compact in compacts:
        read_compact(compact)
    tables = drawn = 0
    for compact in compacts:
        written = tables_from_compact(compact, out or default_tables_folder(compact), figures)
        by_stem: dict[Path, list[Path]] = {}  # a table's .md and .tex, a figure's .png and .pdf
        for path in written:
            by_stem.setdefault(path.with_suffix(""), []).append(path)
        for first, *others in by_stem.values():
            is_table = first.suffix == ".md"
            tables, drawn = tables + is_table, drawn + (not is_table)
            also = f" (and {', '.join(other.suffix for other in others)})" if others else ""
            print(f"[{'table' if is_table else 'figure'}] {first}{also}")
    print(f"[published] {tables} tables and {drawn} figures from {len(compacts)} compact files")


if __name__ == "__main__":
    sys.exit(main())
