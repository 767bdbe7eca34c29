"""A job's samples spread over worker processes, one per core (`workers=N`).

Each worker loads the job's model itself, takes one torch thread, and runs every N-th pending sample
through its own `Evaluator`, exactly as the single process would (greedy decoding: the same records,
only the timings differ, measured where they ran). The parent's own model (loaded to calibrate) is let
go before they start, and it never warms up. The workers send their records back; the parent
keeps every one of them (`keep`: the one writer of records.jsonl, W&B and the progress bar). A worker
that fails stops the job with its error in one line; the records kept so far stay, and a rerun
resumes from them. A worker whose parent is gone (killed, even with SIGKILL) exits at once: no one
would keep its records, and it would hold a model's memory and a core for the rest of its share.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue as queues
import threading
from collections.abc import Callable
from typing import Any

from centroidkv.errors import first_line
from eval.run_config import MethodSpec, RunConfig

SAMPLE_DONE, WORKER_DONE, FAILED = "sample done", "worker done", "failed"


def run_in_workers(
    cfg: RunConfig,
    work: list[tuple[dict[str, Any], list[MethodSpec]]],
    keep: Callable[[dict[str, Any]], None],
    sample_done: Callable[[], None],
) -> None:
    """`work` (samples and their pending methods) over `cfg.workers` processes; RuntimeError (one line)
    when a worker fails or dies."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads
    messages = context.Queue()
    shares = [work[index :: cfg.workers] for index in range(cfg.workers)]
    workers = [
        context.Process(target=_work, args=(cfg, share, messages), daemon=True) for share in shares if share
    ]
    for worker in workers:
        worker.start()
    try:
        running = len(workers)
        while running:
            try:
                kind, payload = messages.get(timeout=5)
            except queues.Empty:
                if not any(worker.is_alive() for worker in workers):
                    raise RuntimeError("a worker process ended without a word (killed?)") from None
                continue
            if kind == FAILED:
                raise RuntimeError(f"a worker failed: {payload}")
            if kind == WORKER_DONE:
                running -= 1
            elif kind == SAMPLE_DONE:
                sample_done()
            else:
                keep(payload)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join()


def load_model_for(cfg: RunConfig) -> tuple[Any, Any]:
    """The job's model and tokenizer (tiny random models: the embedded tokenizer, ids folded into
    their vocabulary). The process keeps the memory it frees from now on (`centroidkv.plan.heap`)."""
    import torch

    from centroidkv import load_model, load_tokenizer
    from centroidkv.models.model_names import EMBEDDED_MODEL
    from centroidkv.plan.heap import keep_freed_memory

    keep_freed_memory()

    device, dtype = cfg.model.resolved()
    model, tokenizer = load_model(cfg.model.name, dtype=getattr(torch, dtype), device=device)
    return model, tokenizer if tokenizer is not None else load_tokenizer(EMBEDDED_MODEL)


def exit_with_parent() -> None:
    """End this process as soon as the process that started it ends (a watcher thread on the parent's
    sentinel; `daemon=True` covers only a parent that exits normally)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _work(cfg: RunConfig, share: list[tuple[dict[str, Any], list[MethodSpec]]], messages: Any) -> None:
    """One worker: its own model, one torch thread, its share of the samples."""
    exit_with_parent()
    try:
        import torch

        from eval.evaluate import Evaluator

        torch.set_num_threads(1)
        model, tokenizer = load_model_for(cfg)
        evaluator = Evaluator.of_job(cfg, model, tokenizer)
        if cfg.warmup:
            evaluator.warm_up()
        for sample, pending in share:
            for record in evaluator.iter_sample(
                sample, pending, cfg.benchmark.max_new_tokens, cfg.benchmark.ignore_eos
            ):
                messages.put(("record", record))
            messages.put((SAMPLE_DONE, None))
        if evaluator.prefill_store is not None:
            print(evaluator.prefill_store.summary(), flush=True)
        messages.put((WORKER_DONE, None))
    except BaseException as error:  # to the parent, which stops the job with it
        messages.put((FAILED, first_line(error, with_type=True)))
