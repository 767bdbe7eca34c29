"""The evaluation of one sample: one shared prefill, then compress + decode per (method variant, budget).

The prompt is prefilled once with a full cache that records what every method needs (query window,
accumulated attention); each (variant, budget) then forks that cache (tensors shared, compressed at
once). kvpress's presses compress inside a prefill: with `share_prefill` (default) one prefill of the
context serves every press and budget of the job, each press compressing its own fork layer by layer
(`centroidkv.decoding.PrefillTap`); that prefill is the native methods' one when the two agree (same
tokens, no record that changes the attention's arithmetic), else a second one. A press that needs a
prefill of its own (`baselines.kvpress_press.OWN_PREFILL`), or every press with
`share_prefill=false`, gets one per (sample, budget).

The forks of a sample are then decoded greedily, up to `decode_batch` of them as the rows of one
batch (`centroidkv.fork_batch`: one weight pass per step for all). TTFT = prefill + the fork's
compression (+ the question in the context-only protocol); TPOT = mean time of the decode steps
after the first, measured only for a fork decoded alone (`decode_batch: 1`; a batched fork's steps
are shared, so its tpot, decode_s and peak_mem are None). Each (variant, budget) gives one record
(with `prefill_shared` and `decode_batch`); a failure gives a failed record.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from centroidkv import get_method
from centroidkv.budget import DEFAULT_BUDGET_UNIT
from centroidkv.decoding import (
    Fork,
    Generation,
    Prefill,
    decode_forks,
    default_eos,
    generate_after_own_prefill,
    needs_of,
    own_prefill,
    prefill,
    start_fork,
)
from centroidkv.errors import first_line
from centroidkv.needs import RECORDERS
from centroidkv.timing import peak_memory, reset_peak_memory
from eval.benchmarks import Benchmark, Sample
from eval.config import DEFAULT_DECODE_BATCH, MethodSpec
from eval.samples import encode_prompt, sample_id


@dataclass
class Run:
    """One (variant, budget) of a sample on its way: a fork to decode, or its result, or its error."""

    spec: MethodSpec
    fork: Fork | None = None
    hooks: Any = None  # a press tap's decoding hooks (its masks), None for a plain fork
    result: dict | None = None
    error: BaseException | None = None
    fields: dict = field(default_factory=dict)  # record fields of the run (prefill_shared, ...)
    restart: tuple | None = None  # `start`'s arguments after the run: to fork it again alone (`decode`)


class Evaluator:
    """Prefill once per sample, then compress + decode per (method, budget)."""

    def __init__(
        self,
        model,
        tokenizer,
        specs: tuple[MethodSpec, ...],
        benchmark: Benchmark,
        budget_unit: str = DEFAULT_BUDGET_UNIT,
        share_prefill: bool = True,
        decode_batch: int = DEFAULT_DECODE_BATCH,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.budget_unit = budget_unit
        self.share_prefill = share_prefill
        self.decode_batch = decode_batch
        self.specs = specs
        self.methods = {spec: get_method(spec.name, **spec.params) for spec in specs}
        self.benchmark = benchmark
        self.context_only = benchmark.context_only
        self.device = next(model.parameters()).device
        self.vocab = model.config.vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = [*(eos if isinstance(eos, list) else [eos]), *default_eos(model)]
        self.eos = {int(e) for e in eos_ids if e is not None and e < self.vocab}

    def ids(self, tokens: list[int]) -> torch.Tensor:
        # Tiny test models have a 512-token vocabulary: fold the embedded tokenizer's ids into it.
        return torch.tensor([[t % self.vocab for t in tokens]], device=self.device)

    def prefill(self, head: list[int], max_new_tokens: int, specs: list[MethodSpec], taps=None) -> Prefill:
        """The sample's shared prefill, recording what every method of `specs` needs (and running `taps`)."""
        methods = [self.methods[s] for s in specs]
        return prefill(self.model, self.ids(head), max_new_tokens, needs=needs_of(methods), taps=taps)

    def run_prompt(
        self,
        prompt: tuple[list[int], list[int]],
        context_prompt: tuple[list[int], list[int]],
        specs: list[MethodSpec],
        max_new_tokens: int,
        eos: set[int],
    ) -> list[Run]:
        """Every (variant, budget) of `specs` on one prompt, given as (prefilled part, fed part) under the
        benchmark's protocol and under the context-only one (kvpress's presses always use the latter)."""
        (head, tail), (context, question) = prompt, context_prompt
        runs = [Run(spec) for spec in specs]
        natives = [run for run in runs if not self.methods[run.spec].compresses_in_prefill]
        taps = {}
        for run in runs:
            if run in natives or not self.share_prefill:
                continue
            tap = self.methods[run.spec].prefill_tap(
                self.model, run.spec.budget, len(context), max_new_tokens
            )
            if tap is not None:
                taps[run.spec] = tap
        tapped = [run for run in runs if run.spec in taps]
        own = [run for run in runs if run not in natives and run not in tapped]

        # One forward for natives and presses when both would prefill the same tokens and nothing the
        # natives record changes the attention's arithmetic (accumulated attention does).
        native_needs = needs_of(self.methods[run.spec] for run in natives)
        one_pass = (
            natives
            and taps
            and head == context
            and not any(RECORDERS[n.name].uses_received for n in native_needs)
        )
        native_prefill = press_prefill = None
        if natives:
            native_prefill = self.prefill(
                head, max_new_tokens, [r.spec for r in natives], taps if one_pass else None
            )
        if taps:
            press_prefill = native_prefill if one_pass else self.prefill(context, max_new_tokens, [], taps)

        for run in natives:
            run.fields = {"prefill_shared": True}
            self.start(run, native_prefill, tail, max_new_tokens)
        for run in tapped:
            run.fields = {"prefill_shared": True, **taps[run.spec].run_fields()}
            done = press_prefill.tapped[run.spec]
            if done.error is not None:
                run.error = done.error
                continue
            if taps[run.spec].masked:  # masks live on the attention modules: decoded alone, under them
                run.hooks = taps[run.spec].decoding_hooks
            own_fork = Prefill(done.cache, press_prefill.first_token, press_prefill.seconds)
            self.start(run, own_fork, question, max_new_tokens, compress_s=done.seconds)
        for run in own:
            run.fields = {"prefill_shared": False}
            try:
                run.result = self.decode_own_prefill(run.spec, context, question, max_new_tokens, eos)
            except Exception as error:
                _free_memory(self.device)
                run.error = error
        self.decode(runs, max_new_tokens, eos)
        return runs

    def start(
        self,
        run: Run,
        prefilled: Prefill,
        fed: list[int],
        max_new_tokens: int,
        compress_s: float | None = None,
    ) -> None:
        """Fork `prefilled` for `run` (compress, feed `fed`), or keep its error. A tapped fork
        (`compress_s` given: its compression's time in the prefill) is compressed already."""
        method = self.methods[run.spec] if compress_s is None else "full"
        budget = run.spec.budget if compress_s is None else 1.0
        question = self.ids(fed) if fed else None
        try:
            with run.hooks(self.model) if run.hooks is not None else nullcontext():
                run.fork = start_fork(
                    self.model, prefilled, method, budget, max_new_tokens, question, self.budget_unit
                )
        except Exception as error:
            _free_memory(self.device)
            run.error = error
            return
        if compress_s is not None:
            run.fork.compress_s = compress_s
        run.restart = (prefilled, fed, max_new_tokens, compress_s)

    def decode(self, runs: list[Run], max_new_tokens: int, eos: set[int]) -> None:
        """Decode the started forks: those without hooks in batches of up to `decode_batch`, the others
        alone. A batch that fails is decoded again fork by fork, so one fork's failure stays its own."""
        pending = [run for run in runs if run.fork is not None]
        batchable = [run for run in pending if run.hooks is None]
        batches = [batchable[i : i + self.decode_batch] for i in range(0, len(batchable), self.decode_batch)]
        batches += [[run] for run in pending if run.hooks is not None]
        for batch in batches:
            reset_peak_memory(self.device)
            try:
                self.decode_batch_of(batch, max_new_tokens, eos)
            except Exception:
                _free_memory(self.device)
                if len(batch) == 1:
                    batch[0].error = sys.exc_info()[1]
                    continue
                for run in batch:  # again, one at a time, from the fork's own (unchanged) source
                    reset_peak_memory(self.device)
                    run.fork = None
                    self.start(run, *run.restart)
                    if run.fork is None:  # `start` kept its error
                        continue
                    try:
                        self.decode_batch_of([run], max_new_tokens, eos)
                    except Exception as error:
                        _free_memory(self.device)
                        run.error = error

    def decode_batch_of(self, batch: list[Run], max_new_tokens: int, eos: set[int]) -> None:
        forks = [run.fork for run in batch]
        with batch[0].hooks(self.model) if batch[0].hooks is not None else nullcontext():
            results = decode_forks(self.model, forks, max_new_tokens, eos)
        peak, peak_kind = peak_memory(self.device) if len(batch) == 1 else (None, None)
        for run, result in zip(batch, results, strict=True):
            run.result = self.measurements(result, eos, peak, peak_kind)
            run.fields["decode_batch"] = len(batch)
            run.fork = None  # its cache can go

    def decode_own_prefill(
        self, spec: MethodSpec, head: list[int], tail: list[int], max_new_tokens: int, eos: set[int]
    ) -> dict:
        """A method that compresses inside its own prefill (kvpress's presses): prefill the context
        with its hooks (compression happens in that forward, so it is part of prefill_s), then feed
        the question and decode on the already compressed cache (no fork, no further compression)."""
        method = self.methods[spec]
        prefilled = own_prefill(self.model, method, spec.budget, self.ids(head), max_new_tokens)
        reset_peak_memory(self.device)  # as for forks: the peak of decoding, not of the prefill
        question = self.ids(tail) if tail else None
        result = generate_after_own_prefill(
            self.model,
            prefilled,
            method,
            spec.budget,
            max_new_tokens,
            eos_token_ids=eos,
            question_ids=question,
        )
        peak, peak_kind = peak_memory(self.device)
        return {**self.measurements(result, eos, peak, peak_kind), **method.run_fields(), "decode_batch": 1}

    def measurements(
        self, result: Generation, eos: set[int], peak: int | None, peak_kind: str | None
    ) -> dict:
        """The record's measurement fields of one decode (None for what a batched decode cannot tell apart)."""
        generated = result.tokens[0]
        if generated and generated[-1] in eos:  # the prediction is the text before the end token
            generated = generated[:-1]
        return dict(
            generated=generated,
            ttft=result.ttft_s,
            tpot=_none_if_nan(result.tpot_s),
            prefill_s=result.ttft_s - result.compress_s - result.feed_s,
            compress_s=result.compress_s,
            feed_s=result.feed_s,
            decode_s=_none_if_nan(result.decode_s),
            n_decode_steps=result.n_decode_steps,
            kv_bytes=result.kv_bytes_compressed,
            kv_bytes_final=result.kv_bytes,
            kv_ratio=result.kv_ratio,
            kv_budget_ratio=result.budget_ratio,
            kv_allocated_ratio=_none_if_nan(result.allocated_ratio),
            kv_len=max(result.seq_lengths, default=0),
            n_compressions=result.n_compressions,
            peak_mem=peak,
            peak_mem_kind=peak_kind,
        )

    def run_sample(
        self, sample: Sample, specs: list[MethodSpec], cap: int | None, ignore_eos: bool = False
    ) -> list[dict]:
        """Records for the pending (method, budget) runs of one sample; failures become failed records."""
        return list(self.iter_sample(sample, specs, cap, ignore_eos))

    def iter_sample(
        self, sample: Sample, specs: list[MethodSpec], cap: int | None, ignore_eos: bool = False
    ) -> Iterator[dict]:
        """`run_sample` one record at a time, in the order of `specs`."""
        base = self.base_record(sample)
        max_new = int(sample.get("max_new_tokens") or 32)
        if cap:
            max_new = min(max_new, cap)
        eos = set() if ignore_eos else self.eos
        try:
            prompt = encode_prompt(sample, self.tokenizer, self.context_only)
            base["context_length"] = sum(map(len, prompt))
            runs = self.run_prompt(prompt, encode_prompt(sample, self.tokenizer, True), specs, max_new, eos)
        except Exception as error:  # the sample is recorded as failed for every method, the job goes on
            _free_memory(self.device)
            for spec in specs:
                yield self.failed(base, spec, error)
            return
        for run in runs:
            own_prefill = self.methods[run.spec].compresses_in_prefill
            record_base = {**base, "protocol": "context_only"} if own_prefill else base
            if run.error is not None or run.result is None:
                yield {
                    **self.failed(record_base, run.spec, run.error or RuntimeError("not decoded")),
                    **run.fields,
                }
                continue
            result = dict(run.result)
            generated = result.pop("generated")
            prediction = self.tokenizer.decode(generated, skip_special_tokens=True)
            record = {**record_base, **self.spec_fields(run.spec), "status": "ok", "prediction": prediction}
            record["score"] = self.benchmark.score(sample, prediction)
            record["n_generated"] = len(generated)
            record.update(result)
            record.update(run.fields)
            yield record

    def base_record(self, sample: Sample) -> dict:
        return {
            "benchmark": self.benchmark.name,
            "task": sample["task"],
            "length": sample.get("length"),
            "depth": sample.get("depth"),
            "sample_id": sample_id(sample),
            "references": sample.get("answers"),
            "protocol": "context_only" if self.context_only else "full_prompt",
            "split": getattr(self.benchmark, "split", None),
            "budget_unit": self.budget_unit,
            **({"source_length": sample["source_length"]} if "source_length" in sample else {}),
        }

    @staticmethod
    def spec_fields(spec: MethodSpec) -> dict:
        return {
            "method": spec.name,
            "variant": spec.variant,
            "params": dict(sorted(spec.params.items())),
            "budget": spec.budget,
        }

    def failed(self, base: dict, spec: MethodSpec, error: BaseException) -> dict:
        message = first_line(error, with_type=True)
        print(f"[failed] {base['sample_id']} {spec.label}: {message}", file=sys.stderr)
        return {
            **base,
            **self.spec_fields(spec),
            "status": "failed",
            "error": message,
            "traceback": "".join(traceback.format_exception(error, limit=5)),
            "score": None,
        }


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(evaluator: Evaluator) -> None:
    """One short untimed run of every method (variants once each), through the sample's own code path,
    so one-time costs stay out of the timings; a method that cannot run on a 200-token prompt fails
    here silently (and is recorded later)."""
    head = list(range(10, 10 + 200))
    one_per_variant = list({spec.variant: spec for spec in evaluator.specs}.values())
    try:
        evaluator.run_prompt((head, []), (head, []), one_per_variant, 4, evaluator.eos)
    except Exception:
        pass


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
