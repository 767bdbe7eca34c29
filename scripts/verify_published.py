"""Does a rerun equal its record? Reruns chosen samples of a committed experiment
(results/<experiment>.jsonl.gz) through the job's own path and prints the records that differ.

  python scripts/verify_published.py results/rerun_check.jsonl.gz            # every sample
  python scripts/verify_published.py results/reproduce_ruler_cpu.jsonl.gz --samples niah_multivalue-4096-3
  python scripts/verify_published.py results/heads.jsonl.gz --first 1       # each task's first sample
  make verify-published VERIFY=results/reproduce_ruler_cpu.jsonl.gz ARGS="--first 1"

Each job of the file is composed again (`experiment=<its experiment> model=<its model>`, then any
`--override`) and must have the committed identity (settings, head files with their hashes, samples;
`--any-head-scores` lets a head file calibrated on this CPU differ in its scores' last digits):
otherwise one line says which keys differ. Its chosen samples then run as the job ran them: the
runner's model and samples (`eval.runner.load_for`), its warm-up, its pending method entries per
sample and its decode batches, in one process of one torch thread, as each of `workers=N` has.
Every field the tables read (`scripts.compact_records.COMPACT_FIELDS`) is compared except those of
the machine (times, load, cores): one line per record that differs, or that all are equal.
Exit status: 0 all equal, 1 some differ, 2 bad input (before any model loads).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from centroidkv.calibrate import NOT_CALIBRATED  # noqa: E402
from eval.compact_store import read_compact  # noqa: E402
from eval.records import cpu_name, record_key  # noqa: E402
from eval.run_config import ConfigError, RunConfig  # noqa: E402
from scripts.compact_records import COMPACT_FIELDS  # noqa: E402

MACHINE_FIELDS = ("ttft", "tpot", "load_1min", "n_cores")  # where and when it ran, not what it computed
COMPARED_FIELDS = tuple(field for field in COMPACT_FIELDS if field not in MACHINE_FIELDS)


def job_config(
    job: str, identity: dict[str, Any], overrides: list[str], results_dir: Path, any_head_scores: bool = False
) -> RunConfig:
    """The run config of committed `job` (experiment/job) composed again; ConfigError (one line) when
    it does not have the committed `identity`."""
    from eval.sweep import plan

    experiment = job.split("/")[0]
    argv = [f"experiment={experiment}", f"model={identity['model.name']}", *overrides]
    configs = plan([*argv, f"results_dir={results_dir}", "logger=none"]) or []
    if len(configs) != 1:
        raise ConfigError([f"{job}: {' '.join(argv)} composes {len(configs)} jobs, not one"])
    config = configs[0]
    found = config.identity()
    if any_head_scores:  # the head files are compared once the rerun has calibrated them
        found = {k: identity.get(k) if k.endswith(".heads_file_read") else v for k, v in found.items()}
    if keys := differing_keys(identity, found, uncalibrated_ok=True):
        differing = identity_differences(identity, found, keys)
        raise ConfigError(
            [f"{job}: {' '.join(argv)} is not the committed job: {differing}; add its overrides (--override)"]
        )
    return config


def identity_differences(committed: dict[str, Any], found: dict[str, Any], keys: list[str]) -> str:
    """The differing `keys` (`differing_keys`), each with its committed and found value ("" when none)."""
    shown = ", ".join(
        f"{key} ({shorten(committed.get(key))} committed, {shorten(found.get(key))} now)" for key in keys[:3]
    )
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def differing_keys(committed: dict[str, Any], found: dict[str, Any], uncalibrated_ok: bool) -> list[str]:
    """The keys where `found` differs from the `committed` identity. With `uncalibrated_ok`, a head file
    this machine has not calibrated yet is no difference: the rerun calibrates it after the model loads
    and checks its hash then."""
    return sorted(
        key
        for key in {*committed, *found}
        if found.get(key) != committed.get(key)
        and not (uncalibrated_ok and str(found.get(key)).endswith(NOT_CALIBRATED))
    )


def heads_listed(model, identity: dict[str, Any], keys: list[str]) -> str:
    """The heads each method whose head file is among `keys` keeps apart, from the file read here."""
    from centroidkv.calibrate import listed_heads_for

    said = []
    for key in keys:
        method = key.removeprefix("methods.").removesuffix(".heads_file_read")
        source = identity[f"methods.{method}.params.heads_file"]
        heads = listed_heads_for(model, source, identity[f"methods.{method}.params.heads_fraction"])
        said.append(f"{method}: {sorted((layer, h) for layer, hs in heads.items() for h in hs)}")
    return "; ".join(said)


def shorten(value: Any, width: int = 60) -> str:
    """repr(value), its middle cut when long: the ends (a file's name, its hash) are what differ."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width // 2 - 2]}...{text[-(width // 2 - 1) :]}"


def chosen(work: list, sample_ids: set[str] | None, first: int | None) -> list:
    """The (sample, pending entries) pairs of `work` named in `sample_ids`, or the first `first` of
    each task and length, or all."""
    from eval.samples import sample_id

    kept, seen = [], {}
    for sample, pending in work:
        where = (sample["task"], sample.get("length"))
        seen[where] = seen.get(where, 0) + 1
        if sample_ids is not None and sample_id(sample) not in sample_ids:
            continue
        if first is not None and seen[where] > first:
            continue
        kept.append((sample, pending))
    return kept


def rerun_job(
    config: RunConfig,
    job: str,
    committed_identity: dict[str, Any],
    sample_ids: set[str] | None,
    first: int | None,
    any_head_scores: bool = False,
) -> list[dict]:
    """The records of the chosen samples of `config`'s job, run again as the job runs them, named
    as its records are (model, experiment, job, the method's fields). `any_head_scores`: a head file
    calibrated here may hash otherwise than the committed one (its scores' last digits change from one
    CPU to another); the heads it lists are printed and the records decide."""
    import torch
    from tqdm.auto import tqdm

    from eval.evaluate import Evaluator
    from eval.runner import load_for, name_record, pending_work

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker of workers=N
    try:
        model, tokenizer, samples = load_for(config)  # calibrates the head files this machine lacks
        found = config.identity()
        if keys := differing_keys(committed_identity, found, uncalibrated_ok=False):
            calibrated = identity_differences(committed_identity, found, keys)
            if not (any_head_scores and all(key.endswith(".heads_file_read") for key in keys)):
                raise ConfigError(
                    [
                        f"{job}: the head files here are not the committed ones: {calibrated} (--any-head-scores)"
                    ]
                )
            print(f"[verify] head files differ ({calibrated}); the heads they list here: "
                  f"{heads_listed(model, found, keys)}", file=sys.stderr)  # fmt: skip
        evaluator = Evaluator.of_job(config, model, tokenizer)
        if config.warmup:
            evaluator.warm_up()
        named = replace(config, job=job.split("/")[1])  # the committed job's name, whatever the overrides
        method_fields = config.method_fields()
        records = []
        work = chosen(pending_work(config, evaluator, samples, set()), sample_ids, first)
        for sample, pending in tqdm(work, desc=f"verify {job}", unit="sample"):
            for record in evaluator.iter_sample(
                sample, pending, config.benchmark.max_new_tokens, config.benchmark.ignore_eos
            ):
                name_record(record, named, method_fields)
                records.append(record)
        return records
    finally:
        torch.set_num_threads(threads)


def record_label(record: dict) -> str:
    return f"{record['experiment']}/{record['job']} {record['sample_id']} {record.get('variant') or record['method']}@{record['budget']:g}"


def differences(committed: list[dict], rerun: list[dict]) -> list[str]:
    """One line per committed record of the rerun samples whose compared fields differ (each field
    `committed -> rerun`), or that the rerun lacks; and per rerun record with no committed one."""
    samples = {(r["experiment"], r["job"], r["sample_id"]) for r in rerun}
    again = {(r["experiment"], r["job"], record_key(r)): r for r in rerun}
    lines = []
    for record in committed:
        if (record["experiment"], record["job"], record["sample_id"]) not in samples:
            continue
        other = again.pop((record["experiment"], record["job"], record_key(record)), None)
        if other is None:
            lines.append(f"{record_label(record)}: not in the rerun")
            continue
        changed = [f for f in COMPARED_FIELDS if f in record and record[f] != other.get(f)]
        if changed:
            said = ", ".join(f"{f} {record[f]!r} -> {other.get(f)!r}" for f in changed)
            lines.append(f"{record_label(record)}: {said}")
    lines.extend(f"{record_label(r)}: not in the committed records" for r in again.values())
    return lines


def verify(
    compact: Path,
    sample_ids: set[str] | None,
    first: int | None,
    overrides: list[str],
    jobs: set[str] | None,
    any_head_scores: bool = False,
) -> tuple[int, list[str], list[str]]:
    """(records rerun, lines of the records that differ, the CPUs the file names) for the chosen jobs
    and samples of `compact`; every job's config is checked before any model loads (ConfigError,
    CompactError)."""
    header, committed = read_compact(compact)
    identities = {
        job: identity
        for job, identity in header["identities"].items()
        if jobs is None or job in jobs or job.split("/")[1] in jobs
    }
    if not identities:
        raise ConfigError([f"{compact}: no job named {', '.join(sorted(jobs or []))}"])
    with tempfile.TemporaryDirectory() as results_dir:
        configs = {
            job: job_config(job, identity or {}, overrides, Path(results_dir), any_head_scores)
            for job, identity in identities.items()
        }
        rerun = [
            record
            for job, config in configs.items()
            for record in rerun_job(config, job, identities[job] or {}, sample_ids, first, any_head_scores)
        ]
    return len(rerun), differences(committed, rerun), header.get("cpus", [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "compact", type=Path, help="a committed compact records file (results/<experiment>.jsonl.gz)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--samples", help="comma-separated sample ids (e.g. niah_multivalue-4096-3)")
    which.add_argument("--first", type=int, help="the first N samples of each task and length")
    parser.add_argument("--job", action="append", help="only this job (experiment/job or job); repeatable")
    parser.add_argument(
        "--override", action="append", default=[], help="a scripts/run.py override the job was made with"
    )
    parser.add_argument(
        "--any-head-scores",
        action="store_true",
        help="accept a head file calibrated here that hashes otherwise (scores differ by CPU); prints its heads",
    )
    args = parser.parse_args(argv)
    from eval.compact_store import CompactError

    if args.first is not None and args.first < 1:
        print("error: --first must be at least 1", file=sys.stderr)
        return 2
    sample_ids = set(args.samples.split(",")) if args.samples else None
    try:
        n_rerun, lines, committed_cpus = verify(
            args.compact,
            sample_ids,
            args.first,
            args.override,
            set(args.job or []) or None,
            args.any_head_scores,
        )
    except (ConfigError, CompactError, OSError) as error:
        for line in getattr(error, "lines", None) or [str(error)]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if n_rerun == 0:
        print(f"error: {args.compact}: no record rerun (no sample chosen)", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    committed_on = ", ".join(committed_cpus) or "a CPU the file does not name"
    print(f"[verify] committed on {committed_on}; rerun on {cpu_name()}")
    print(
        f"[verify] {n_rerun} records rerun: "
        + (f"{len(lines)} differ" if lines else "all equal to the committed ones")
    )
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
