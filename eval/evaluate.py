"""The evaluation of one sample: its prompt through every (method variant, budget), into records.

The library's per-prompt plan (`centroidkv.plan.plan.run`) runs every (variant, budget) of a sample in one
call: one shared prefill for the native methods, kvpress's presses compressing forks of a shared
prefill of the context (`share_prefill`, default) or their own, the forks decoded up to
`decode_batch` at a time as the rows of one batch. This module only turns a sample into the plan's
prompt and the plan's outcomes into records: the prediction and its score, the measurements
(`centroidkv.plan.measurements`, by their record names) and the run's fields (`prefill_shared`,
`decode_batch`, a press's `kv_masked`); a failure gives a failed record.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator

from centroidkv import get_method
from centroidkv.cache.budget import DEFAULT_BUDGET_UNIT
from centroidkv.errors import first_line
from centroidkv.plan.decoding import eos_token_ids
from centroidkv.plan.plan import CONTEXT_ONLY, DEFAULT_DECODE_BATCH, FULL_PROMPT, Outcome, Prompt, Run, run
from centroidkv.plan.prefill_compressor import compresses_in_prefill
from centroidkv.plan.prefill_store import PrefillStore, open_store
from eval.benchmarks import Benchmark, Sample
from eval.run_config import MethodSpec, RunConfig
from eval.samples import sample_id, sample_prompt


class Evaluator:
    """One sample at a time through every (method, budget): the plan's outcomes as records."""

    def __init__(
        self,
        model,
        tokenizer,
        specs: tuple[MethodSpec, ...],
        benchmark: Benchmark,
        budget_unit: str = DEFAULT_BUDGET_UNIT,
        share_prefill: bool = True,
        decode_batch: int = DEFAULT_DECODE_BATCH,
        prefill_store: PrefillStore | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.prefill_store = prefill_store  # the samples' native prefills, kept for later jobs
        self.budget_unit = budget_unit
        self.share_prefill = share_prefill
        self.decode_batch = decode_batch
        self.specs = specs
        self.methods = {spec: get_method(spec.name, **spec.params) for spec in specs}
        # the specs whose method compresses inside its prefill: the only runs that read a prompt's
        # context-only split under the full-prompt protocol
        self.in_prefill = {spec for spec in specs if compresses_in_prefill(self.methods[spec])}
        self.benchmark = benchmark
        self.vocab = model.config.vocab_size
        self.eos = eos_token_ids(model, tokenizer)

    @classmethod
    def of_job(cls, cfg: RunConfig, model, tokenizer) -> Evaluator:
        """The evaluator of a job's config (its methods, benchmark, budget unit, prefill sharing, decode
        batch and prefill store)."""
        store = open_store(cfg.prefill_store.max_gb, cfg.prefill_store.dir)
        return cls(
            model,
            tokenizer,
            cfg.methods,
            cfg.benchmark,
            cfg.budget_unit,
            cfg.share_prefill,
            cfg.decode_batch,
            store,
        )

    def prompt(self, sample: Sample, specs: list[MethodSpec] | None = None) -> Prompt:
        """The sample's prompt under the benchmark's protocol, its text rendered once: the context-only
        split of a full-prompt benchmark is made only when one of `specs` (None: every method of the
        job) compresses inside its prefill, the only runs that read it (`Prompt.context`, empty
        otherwise). Tiny test models have a 512-token vocabulary: the embedded tokenizer's ids are
        folded into it."""
        split_context = any(spec in self.in_prefill for spec in specs or self.specs)
        return sample_prompt(sample, self.tokenizer, self.benchmark.context_only, split_context, self.vocab)

    def warm_up(self) -> None:
        """One short untimed run of every method (variants once each), through the sample's own code
        path, so one-time costs stay out of the timings. A method that cannot run on a 200-token prompt
        fails here without a word (`run` returns its error as an outcome, which is dropped); the
        samples' own runs record it."""
        head = list(range(10, 10 + 200))
        one_per_variant = list({spec.variant: spec for spec in self.specs}.values())
        self.run_prompt(Prompt(head, [], head, []), one_per_variant, 4, self.eos, stored=False)

    def run_prompt(
        self, prompt: Prompt, specs: list[MethodSpec], max_new_tokens: int, eos: set[int], stored: bool = True
    ) -> list[Outcome]:
        """Every run of `specs` on `prompt` (`centroidkv.plan.plan.run`); `stored`: through the prefill store
        when the job has one (the warm-up's prompt is not kept)."""
        runs = [Run(self.methods[spec], spec.budget) for spec in specs]
        return run(
            self.model,
            prompt,
            runs,
            max_new_tokens,
            eos,
            self.budget_unit,
            share_prefill=self.share_prefill,
            decode_batch=self.decode_batch,
            prefill_store=self.prefill_store if stored else None,
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
            prompt = self.prompt(sample, specs)
            base["context_length"] = len(prompt.prefilled) + len(prompt.fed)
            outcomes = self.run_prompt(prompt, specs, max_new, eos)
        except Exception as error:  # the sample is recorded as failed for every method, the job goes on
            for spec in specs:
                yield self.failed(base, spec, error)
            return
        for spec, outcome in zip(specs, outcomes, strict=True):
            record_base = {**base, "protocol": outcome.protocol}
            if outcome.generation is None:
                error = outcome.error or RuntimeError("not decoded")
                yield {**self.failed(record_base, spec, error), **outcome.fields}
                continue
            prediction = self.tokenizer.decode(outcome.answer_ids, skip_special_tokens=True)
            record = {**record_base, **self.spec_fields(spec), "status": "ok", "prediction": prediction}
            record["score"] = self.benchmark.score(sample, prediction)
            record.update(self.benchmark.record_fields(sample, prediction, record["score"]))
            record["n_generated"] = len(outcome.answer_ids)
            record.update(outcome.generation.measured)
            record.update(outcome.fields)
            yield record

    def base_record(self, sample: Sample) -> dict:
        return {
            "benchmark": self.benchmark.name,
            "task": sample["task"],
            "length": sample.get("length"),
            "depth": sample.get("depth"),
            "sample_id": sample_id(sample),
            "references": sample.get("answers"),
            "protocol": CONTEXT_ONLY if self.benchmark.context_only else FULL_PROMPT,
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
