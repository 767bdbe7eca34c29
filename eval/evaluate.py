"""The evaluation of one sample: one shared prefill, then compress + decode per (method variant, budget).

The prompt is prefilled once with a full cache that records what every method needs (query window,
accumulated attention); each (variant, budget) then forks that cache (tensors shared, compressed at
once) and decodes greedily, both through `centroidkv.decoding`. TTFT = prefill + the fork's
compression (+ the question in the context-only protocol); TPOT = mean time of the decode steps
after the first. Each (variant, budget) gives one record; a failure gives a failed record.
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Iterator

import torch

from centroidkv import get_method
from centroidkv.budget import DEFAULT_BUDGET_UNIT
from centroidkv.decoding import (
    Generation,
    Prefill,
    default_eos,
    generate_after_own_prefill,
    generate_from,
    needs_of,
    own_prefill,
    prefill,
)
from eval.benchmarks import Benchmark, Sample
from eval.config import MethodSpec
from eval.samples import encode_prompt, sample_id
from eval.timing import peak_memory, reset_peak_memory


class Evaluator:
    """Prefill once per sample, then compress + decode per (method, budget)."""

    def __init__(
        self,
        model,
        tokenizer,
        specs: tuple[MethodSpec, ...],
        benchmark: Benchmark,
        budget_unit: str = DEFAULT_BUDGET_UNIT,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.budget_unit = budget_unit
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

    def prefill(self, head: list[int], max_new_tokens: int, specs: list[MethodSpec]) -> Prefill:
        """The sample's shared prefill, recording what every method of `specs` needs."""
        methods = [self.methods[s] for s in specs]
        return prefill(self.model, self.ids(head), max_new_tokens, needs=needs_of(methods))

    def decode(
        self,
        prefilled: Prefill,
        spec: MethodSpec,
        tail: list[int],
        max_new_tokens: int,
        eos: set[int] | None = None,
    ) -> dict:
        """Fork, compress, (feed the question,) decode greedily; returns the measurements."""
        eos = self.eos if eos is None else eos
        reset_peak_memory(self.device)
        result = generate_from(
            self.model,
            prefilled,
            self.methods[spec],
            spec.budget,
            max_new_tokens,
            eos_token_ids=eos,
            question_ids=self.ids(tail) if tail else None,
            budget_unit=self.budget_unit,
        )
        return self.measurements(prefilled, result, eos)

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
        return {**self.measurements(prefilled, result, eos), **method.run_fields()}

    def measurements(self, prefilled: Prefill, result: Generation, eos: set[int]) -> dict:
        """The record's measurement fields of one decode."""
        generated = result.tokens[0]
        if generated and generated[-1] in eos:  # the prediction is the text before the end token
            generated = generated[:-1]
        peak, peak_kind = peak_memory(self.device)
        return dict(
            generated=generated,
            ttft=result.ttft_s,
            tpot=None if math.isnan(result.tpot_s) else result.tpot_s,
            prefill_s=prefilled.seconds,
            compress_s=result.compress_s,
            feed_s=result.feed_s,
            decode_s=result.decode_s,
            n_decode_steps=result.n_decode_steps,
            kv_bytes=result.kv_bytes_compressed,
            kv_bytes_final=result.kv_bytes,
            kv_ratio=result.kv_ratio,
            kv_budget_ratio=result.budget_ratio,
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
        """`run_sample` one record at a time, each as soon as its decode is done (so it can be saved)."""
        base = self.base_record(sample)
        max_new = int(sample.get("max_new_tokens") or 32)
        if cap:
            max_new = min(max_new, cap)
        # Methods that compress inside their own prefill always run context-only (kvpress's protocol).
        shared = [s for s in specs if not self.methods[s].compresses_in_prefill]
        try:
            head, tail = encode_prompt(sample, self.tokenizer, self.context_only)
            base["context_length"] = len(head) + len(tail)
            own_head, own_tail = encode_prompt(sample, self.tokenizer, True)
            prefilled = self.prefill(head, max_new, shared) if shared else None
        except Exception as error:  # the sample is recorded as failed for every method, the job goes on
            _free_memory(self.device)
            for spec in specs:
                yield self.failed(base, spec, error)
            return
        eos = set() if ignore_eos else self.eos
        for spec in specs:
            own_prefill = self.methods[spec].compresses_in_prefill
            record_base = {**base, "protocol": "context_only"} if own_prefill else base
            try:
                if own_prefill:
                    result = self.decode_own_prefill(spec, own_head, own_tail, max_new, eos)
                else:
                    result = self.decode(prefilled, spec, tail, max_new, eos)
            except Exception as error:
                _free_memory(self.device)
                yield self.failed(record_base, spec, error)
                continue
            generated = result.pop("generated")
            prediction = self.tokenizer.decode(generated, skip_special_tokens=True)
            record = {**record_base, **self.spec_fields(spec), "status": "ok", "prediction": prediction}
            record["score"] = self.benchmark.score(sample, prediction)
            record["n_generated"] = len(generated)
            record.update(result)
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
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        print(f"[failed] {base['sample_id']} {spec.label}: {message}", file=sys.stderr)
        return {
            **base,
            **self.spec_fields(spec),
            "status": "failed",
            "error": message,
            "traceback": traceback.format_exc(limit=5),
            "score": None,
        }


def _free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(evaluator: Evaluator) -> None:
    """One short untimed prefill + decode per method, so one-time costs stay out of the timings."""
    head = list(range(10, 10 + 200))
    specs = list(evaluator.specs)
    shared = [s for s in specs if not evaluator.methods[s].compresses_in_prefill]
    prefilled = evaluator.prefill(head, 4, shared) if shared else None
    own = {s.variant: s for s in specs if s not in shared}  # one own-prefill warm-up per variant
    for spec in shared + list(own.values()):
        try:
            if spec in shared:
                evaluator.decode(prefilled, spec, [], 4)
            else:
                evaluator.decode_own_prefill(spec, head, [], 4, evaluator.eos)
        except Exception:  # a method that cannot run on a 200-token prompt will fail (and be recorded) later
            pass
