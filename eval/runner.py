"""The job loop: one job = one model x a list of (method variant, budget) x a benchmark's samples.

Each sample is evaluated by `eval.evaluate.Evaluator` (one shared prefill, a fork per variant and
budget); one JSON line per sample x variant x budget goes to `results/<experiment>/<job>/records.jsonl`
as soon as it is known (`eval.records`), so a killed job resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from eval.config import RunConfig
from eval.evaluate import Evaluator, warm_up
from eval.records import JobStore, environment, record_key


class SetupError(RuntimeError):
    """The model or the samples could not be loaded (hub unreachable, data missing): nothing was written."""


def summarize(records: list[dict]) -> dict[str, Any]:
    """Mean score / TPOT / KV bytes per variant@budget, plus counts."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[f"{record.get('variant') or record['method']}@{record['budget']:g}"].append(record)
    summary: dict[str, Any] = {
        "n_records": len(records),
        "n_failed": sum(r["status"] != "ok" for r in records),
    }
    for label, group in sorted(groups.items()):
        ok = [r for r in group if r["status"] == "ok"]
        for metric in ("score", "tpot", "ttft", "kv_bytes"):
            values = [r[metric] for r in ok if r.get(metric) is not None and not math.isnan(r[metric])]
            if values:
                summary[f"{label}/{metric}"] = sum(values) / len(values)
    return summary


def run_job(cfg: RunConfig, config_yaml: str) -> dict[str, Any] | None:
    """Run (or resume) one job; returns its summary, or None when it was already finished."""
    store = JobStore(cfg.job_dir)
    if store.finished:
        print(f"[skip] {cfg.job_dir} is finished (delete done.json to rerun it)")
        return None
    from centroidkv import load_model, load_tokenizer

    dtype = getattr(torch, cfg.model.dtype) if cfg.model.dtype else None
    try:
        model, tokenizer = load_model(cfg.model.name, dtype=dtype, device=cfg.model.device)
        if tokenizer is None:  # tiny random models: the embedded tokenizer, ids folded into their vocabulary
            tokenizer = load_tokenizer("smollm2-135m")
        samples = cfg.benchmark.samples(tokenizer)
    except (RuntimeError, OSError, ImportError, ValueError) as error:  # hub unreachable, missing data
        raise SetupError(
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from error
    device = str(next(model.parameters()).device)
    store.prepare(config_yaml, environment(device))
    existing = store.load()
    done = {record_key(r) for r in existing if r["status"] == "ok" or not cfg.retry_failed}

    from eval.wandb_logger import make_logger

    logger = make_logger(cfg, OmegaConf.to_container(OmegaConf.create(config_yaml)))
    evaluator = Evaluator(model, tokenizer, cfg.methods, cfg.benchmark)
    if cfg.warmup:
        warm_up(evaluator)
    records = list(existing)
    started = time.perf_counter()
    bar = tqdm(samples, desc=f"{cfg.experiment}/{cfg.job}", unit="sample", dynamic_ncols=True)
    for sample in bar:
        probe = evaluator.base_record(sample)
        pending = [s for s in cfg.methods if record_key({**probe, **evaluator.spec_fields(s)}) not in done]
        if not pending:
            continue
        for record in evaluator.iter_sample(
            sample, pending, cfg.benchmark.max_new_tokens, cfg.benchmark.ignore_eos
        ):
            record.update(model=cfg.model.name, experiment=cfg.experiment, job=cfg.job)
            store.append(record)
            logger.log_record(record)
            records = [r for r in records if record_key(r) != record_key(record)] + [record]
        ok = [r for r in records if r["status"] == "ok" and r.get("score") is not None]
        if ok:
            bar.set_postfix(
                score=f"{sum(r['score'] for r in ok) / len(ok):.1f}", failed=len(records) - len(ok)
            )
    summary = summarize(records)
    summary["wall_s"] = time.perf_counter() - started
    logger.finish(summary, records)
    store.finish(summary)
    return summary


def config_yaml_of(cfg: RunConfig, composed: Any) -> str:
    """The composed Hydra config plus the validated run config, as saved in the job folder."""
    resolved = OmegaConf.to_container(composed, resolve=True) if composed is not None else {}
    validated = json.loads(json.dumps({**asdict(cfg), "benchmark": cfg.benchmark.params()}, default=str))
    return OmegaConf.to_yaml(OmegaConf.create({"composed": resolved, "validated": validated}))
