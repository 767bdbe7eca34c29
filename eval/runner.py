"""The job loop: one job = one model x a list of (method variant, budget) x a benchmark's samples.

Each sample is evaluated by `eval.evaluate.Evaluator` (one shared prefill, a fork per variant and
budget); one JSON line per sample x variant x budget goes to `results/<experiment>/<job>/records.jsonl`
as soon as it is known (`eval.records`), so a killed job resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from centroidkv.errors import first_line
from centroidkv.models.hub_probe import offline_unless_reachable
from centroidkv.plan.measurements import table_measurements
from eval.evaluate import Evaluator
from eval.job_store import JobStore
from eval.machine_load import machine_load
from eval.records import (
    JobError,
    check_results_folder,
    environment,
    finished_message,
    record_key,
    scan_records,
)
from eval.run_config import RunConfig


class SetupError(JobError):
    """The model or the samples could not be loaded (hub unreachable, data missing)."""


class JobInterrupted(JobError):
    """The job was stopped with Ctrl-C (SIGINT); every record written before is kept."""

    exit_code = 130  # a shell's status for a process ended by SIGINT


class NoSuccessError(JobError):
    """Every record of the job failed: it is not marked done; a rerun retries the failed records only
    with retry_failed=true (by default they are kept and skipped)."""


def summarize(records: list[dict], n_dropped_lines: int = 0) -> dict[str, Any]:
    """Mean score and mean of every table measurement (`centroidkv.plan.measurements`) per
    variant@budget, plus counts (records, failed, torn or corrupt lines dropped from records.jsonl when
    the job resumed)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[f"{record.get('variant') or record['method']}@{record['budget']:g}"].append(record)
    summary: dict[str, Any] = {
        "n_records": len(records),
        "n_failed": sum(r["status"] != "ok" for r in records),
        "n_dropped_lines": n_dropped_lines,
    }
    for label, group in sorted(groups.items()):
        ok = [r for r in group if r["status"] == "ok"]
        for metric in ("score", *(m.name for m in table_measurements())):
            values = [
                r[metric] for r in ok if isinstance(r.get(metric), (int, float)) and not math.isnan(r[metric])
            ]
            if values:
                summary[f"{label}/{metric}"] = sum(values) / len(values)
    return summary


def run_job(cfg: RunConfig, config_yaml: str) -> dict[str, Any] | None:
    """Run (or resume) one job; returns its summary, or None when it was already finished.

    Before the model loads: the results folder is checked (writable, room for the records), the job's
    lock is taken, the folder's saved identity must match this config's (unless `overwrite`), and its
    records must all be the job's own. Raises a JobError (one line) when the job cannot run, when no
    record succeeded, or when it is interrupted (Ctrl-C: JobInterrupted, exit status 130).
    """
    store = JobStore(cfg.job_dir)
    if store.skipped_as_finished(cfg.overwrite):  # its identity must still be this config's
        store.check_identity(cfg.identity())
        print(finished_message(cfg.job_dir))
        return None
    check_results_folder(cfg.job_dir, cfg.needed_bytes)
    stale = store.lock()
    try:
        if stale:
            print(
                f"[lock] {cfg.job_dir}: took over the lock of {stale}, which is no longer running",
                file=sys.stderr,
            )
        return _run_locked(cfg, config_yaml, store)
    except KeyboardInterrupt:
        n_records = len(scan_records(store.records_path).records)  # whole lines only, as a resume reads
        raise JobInterrupted(
            f"{cfg.job_dir}: interrupted after {n_records} record(s), all kept in {store.records_path.name}; "
            "rerun the same command to resume"
        ) from None
    finally:
        store.unlock()


def job_owner(cfg: RunConfig) -> dict[str, str]:
    """What every record of the job names as its writer (see `eval.job_store.JobStore.saved_owner`)."""
    return {"model": cfg.model.name, "experiment": cfg.experiment, "job": cfg.job}


def _run_locked(cfg: RunConfig, config_yaml: str, store: JobStore) -> dict[str, Any] | None:
    identity = cfg.identity()
    if not _store_open(cfg, store, identity):
        return None
    model, tokenizer, samples = load_for(cfg)
    resolved = cfg.identity()  # a head file calibrated just now is named with its content hash
    if resolved != identity:
        identity = resolved
        store.check_identity(identity)
    method_fields = cfg.method_fields()  # what every record names besides its parameters
    document = OmegaConf.to_container(OmegaConf.create(config_yaml)) or {}
    document["identity"] = identity
    store.prepare(
        OmegaConf.to_yaml(OmegaConf.create(document)), environment(str(next(model.parameters()).device))
    )
    existing = _load_existing(store)
    done = {record_key(r) for r in existing if r["status"] == "ok" or not cfg.retry_failed}

    from eval.wandb_logger import make_logger

    logger = make_logger(cfg, document)
    evaluator = Evaluator.of_job(cfg, model, tokenizer)
    del model
    if cfg.workers > 1:  # each worker loads, warms up and runs its own copy: this one would sit idle
        evaluator.model = None
    elif cfg.warmup:
        evaluator.warm_up()
    records = {record_key(r): r for r in existing}
    started = time.perf_counter()

    def keep(record: dict[str, Any]) -> None:
        name_record(record, cfg, method_fields)
        store.append(record)
        logger.log_record(record)
        records.pop(record_key(record), None)  # a retried record moves to the end, as in the file
        records[record_key(record)] = record

    _run_samples(cfg, evaluator, samples, done, keep, records)
    if evaluator.prefill_store is not None and cfg.workers == 1:  # each worker says its own
        print(evaluator.prefill_store.summary())
    summary = summarize(list(records.values()), store.n_dropped)
    summary["wall_s"] = time.perf_counter() - started
    logger.finish(summary, list(records.values()))
    if summary["n_records"] == summary["n_failed"]:
        first = next((r.get("error") for r in records.values() if r.get("error")), "no sample")
        retry = "" if cfg.retry_failed else "; a rerun skips failed records: retry_failed=true retries them"
        raise NoSuccessError(
            f"{cfg.job_dir}: none of the {summary['n_records']} records succeeded (first error: {first}); "
            f"the job is not marked done{retry}"
        )
    store.finish(summary)
    return summary


def name_record(record: dict[str, Any], cfg: RunConfig, method_fields: dict[str, dict[str, Any]]) -> None:
    """What a record of `cfg`'s job says besides its outcome: the job that wrote it, the machine's
    load, and its variant's fields beyond the parameters (`RunConfig.method_fields`)."""
    record.update(model=cfg.model.name, experiment=cfg.experiment, job=cfg.job, **machine_load())
    record.update(method_fields.get(record.get("variant"), {}))


def _store_open(cfg: RunConfig, store: JobStore, identity: dict[str, Any]) -> bool:
    """Whether the job has work to do in `store`: set aside its records under overwrite=true, refuse
    another job's folder, and say so (False) when the job is finished."""
    if cfg.overwrite and store.has_results:
        kept = store.set_aside()
        print(
            f"[overwrite] {cfg.job_dir}: starting again"
            + (f", previous records kept as {kept.name}" if kept else "")
        )
    store.check_identity(identity)
    if store.finished:
        print(finished_message(cfg.job_dir))
        return False
    store.check_own_records(job_owner(cfg))
    return True


def _load_existing(store: JobStore) -> list[dict[str, Any]]:
    """The records already written, saying on stderr when torn or corrupt lines were dropped."""
    existing = store.load()
    if store.n_dropped:
        kept = f"; the complete ones are kept in {store.kept_aside.name}" if store.kept_aside else ""
        print(
            f"[resume] {store.records_path}: dropped {store.n_dropped} torn or corrupt line(s){kept}",
            file=sys.stderr,
        )
    return existing


def load_for(cfg: RunConfig) -> tuple[Any, Any, list]:
    """The job's model, tokenizer and samples, with the head files its methods need (calibrated now
    when missing, never inside a compression); SetupError (one line) when any of it fails."""
    from centroidkv import get_method
    from centroidkv.models.model_names import HUB_MODELS, model_kind
    from eval.calibrate import calibrate_missing

    if cfg.model.name in HUB_MODELS or model_kind(cfg.model.name) == "hub" or cfg.benchmark.needs_hub:
        offline_unless_reachable()
    from eval.workers import load_model_for

    try:
        model, tokenizer = load_model_for(cfg)
        samples = cfg.benchmark.samples(tokenizer)
        calibrate_missing(model, [get_method(spec.name, **spec.params) for spec in cfg.methods])
    except (RuntimeError, OSError, ImportError, ValueError) as error:  # hub unreachable, missing data
        raise SetupError(first_line(error, with_type=True)) from None
    return model, tokenizer, samples


def pending_work(
    cfg: RunConfig, evaluator: Evaluator, samples: list, done: set
) -> list[tuple[dict[str, Any], list]]:
    """Each sample with the method entries it still needs, in the job's order: an entry with a samples
    cap runs on the first samples of each task and length (`MethodSpec.runs_on`), and a record key in
    `done` is not run again; samples with nothing left are left out."""
    work, seen = [], Counter()
    for sample in samples:
        probe = evaluator.base_record(sample)
        position = seen[probe["task"], probe["length"]]
        seen[probe["task"], probe["length"]] += 1
        pending = [
            s
            for s in cfg.methods
            if s.runs_on(probe["length"], position)
            and record_key({**probe, **evaluator.spec_fields(s)}) not in done
        ]
        if pending:
            work.append((sample, pending))
    return work


def _run_samples(
    cfg: RunConfig,
    evaluator: Evaluator,
    samples: list,
    done: set,
    keep: Callable[[dict[str, Any]], None],
    records: dict,
) -> None:
    """Each sample's pending methods through the evaluator (or `cfg.workers` processes of their own:
    `eval.workers`), every record to `keep` as it comes; the progress bar shows the running score of
    `records` (kept ones included)."""
    work = pending_work(cfg, evaluator, samples, done)
    skipped = len(samples) - len(work)
    # closed on an interrupt too, so that the one error line starts a line of its own
    bar = tqdm(
        total=len(samples),
        initial=skipped,
        desc=f"{cfg.experiment}/{cfg.job}",
        unit="sample",
        dynamic_ncols=True,
    )
    with bar:

        def sample_done() -> None:
            bar.update(1)
            ok = [r for r in records.values() if r["status"] == "ok" and r.get("score") is not None]
            if ok:
                bar.set_postfix(
                    score=f"{sum(r['score'] for r in ok) / len(ok):.1f}", failed=len(records) - len(ok)
                )

        if cfg.workers > 1:
            from eval.workers import run_in_workers

            run_in_workers(cfg, work, keep, sample_done)
        else:
            for sample, pending in work:
                for record in evaluator.iter_sample(
                    sample, pending, cfg.benchmark.max_new_tokens, cfg.benchmark.ignore_eos
                ):
                    keep(record)
                sample_done()


def config_yaml_of(cfg: RunConfig, composed: Any) -> str:
    """The command line's overrides that name the job (`overrides`: its folder name's hash covers
    them), the composed Hydra config and the validated run config, as saved in the job folder."""
    resolved = OmegaConf.to_container(composed, resolve=True) if composed is not None else {}
    validated = json.loads(json.dumps({**asdict(cfg), "benchmark": cfg.benchmark.params()}, default=str))
    overrides = validated.pop("overrides", [])
    return OmegaConf.to_yaml(
        OmegaConf.create({"overrides": overrides, "composed": resolved, "validated": validated})
    )
