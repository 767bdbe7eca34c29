"""The runner: one job = one model x a list of (method, budget) x a benchmark's samples.

Per sample the prompt is prefilled once with a full cache that records what every method needs
(query window, accumulated attention); each (method, budget) then forks that cache (tensors shared,
compressed at once) and decodes greedily, both through `centroidkv.decoding`. TTFT = prefill + the
fork's compression (+ the question in the context-only protocol); TPOT = mean time of the decode
steps after the first. One JSON line per
sample x method x budget goes to `results/<experiment>/<job>/records.jsonl` as soon as it is known.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from centroidkv.decoding import Prefill, default_eos, generate_from, needs_of, prefill
from eval.config import MethodSpec, RunConfig
from eval.records import JobStore, environment, record_key
from eval.timing import peak_memory, reset_peak_memory

Sample = dict[str, Any]


# --------------------------------------------------------------------------------------------- samples
def _toy_samples(bench, tokenizer) -> list[Sample]:
    """A self-contained key-value recall task (no eval.* dependency): for smoke tests and CI."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    samples = []
    for task in bench.tasks:
        for length in bench.lengths:
            rng = random.Random(f"{bench.seed}-{task}-{length}")
            for index in range(bench.n_samples):
                key, value = rng.choice(words), str(rng.randrange(10**6, 10**7))
                needle = f"The special magic number for {key} is: {value}. "
                n_fill = max(1, length // 24)
                depth = rng.randrange(n_fill)
                context = filler * depth + needle + filler * (n_fill - depth)
                question = f"What is the special magic number for {key}?"
                samples.append(
                    dict(
                        task=task,
                        index=index,
                        input=context + "\n" + question,
                        context=context,
                        question=question,
                        answer_prefix=" Answer:",
                        answers=[value],
                        max_new_tokens=12,
                        length=length,
                    )
                )
    return samples


def load_samples(bench, tokenizer) -> list[Sample]:
    """The benchmark's samples, interleaved across tasks and lengths (sample 0 of every task first), so
    that a job stopped early still covers every task."""
    samples = _load_samples(bench, tokenizer)
    order = {key: i for i, key in enumerate(dict.fromkeys((s["task"], s.get("length")) for s in samples))}
    position: dict[tuple, int] = {}
    ranked = []
    for sample in samples:
        key = (sample["task"], sample.get("length"))
        position[key] = position.get(key, -1) + 1
        ranked.append((position[key], order[key], sample))
    return [sample for *_, sample in sorted(ranked, key=lambda item: item[:2])]


def _load_samples(bench, tokenizer) -> list[Sample]:
    """The benchmark's samples, each with `task`, `length`, `input`, `answers`, `max_new_tokens`."""
    if bench.name == "toy":
        return _toy_samples(bench, tokenizer)
    if bench.name == "ruler":
        from eval import ruler

        out = []
        for task in bench.tasks:
            for length in bench.lengths:
                try:
                    samples = ruler.generate_samples(
                        task, length, tokenizer, bench.n_samples, seed=bench.seed
                    )
                except RuntimeError as error:  # qa_1/qa_2 need the hub: skip them, run the other tasks
                    if not task.startswith("qa"):
                        raise
                    print(f"[skip] {task}: {str(error).splitlines()[0]}", file=sys.stderr)
                    continue
                out.extend({**sample, "length": length} for sample in samples)
        if not out:
            raise RuntimeError("no RULER samples could be generated")
        return out
    if bench.name == "longbench":
        from eval import longbench

        out = []
        for dataset in bench.tasks:
            is_e = dataset.endswith("_e")
            max_length = bench.lengths[0] if bench.lengths else 31500
            for sample in longbench.load_samples(
                dataset.removesuffix("_e"),
                tokenizer,
                data_dir=bench.data_dir,
                max_length=max_length,
                n=bench.n_samples,
                e=is_e,
            ):
                # `length` is the truncation length (the table's context); LongBench's own length field
                # (words, for the LongBench-E buckets) is kept as source_length.
                out.append(
                    {**sample, "task": dataset, "length": max_length, "source_length": sample.get("length")}
                )
        return out
    if bench.name == "niah":
        from eval import niah

        samples = niah.generate_niah(
            list(bench.lengths),
            list(bench.depths),
            tokenizer,
            seed=bench.seed,
            n=bench.n_samples,
            progress=False,
        )
        # `length` is the target context length (the heatmap's column), not the prompt's token count.
        return [
            {**s, "task": s.get("task", "niah"), "length": s.get("target_length", s["length"])}
            for s in samples
        ]
    raise ValueError(f"unknown benchmark {bench.name!r}")


def sample_id(sample: Sample) -> str:
    parts = [
        sample.get("task"),
        sample.get("length"),
        sample.get("depth"),
        sample.get("index", sample.get("_id")),
    ]
    return "-".join(str(p) for p in parts if p is not None)


def score_sample(bench_name: str, sample: Sample, prediction: str) -> float:
    """The benchmark's metric for one prediction, 0-100."""
    if bench_name == "longbench":
        from eval.metrics import longbench_score

        dataset = sample.get("dataset") or sample["task"].removesuffix("_e")
        return float(longbench_score(dataset, prediction, sample["answers"], sample.get("all_classes")))
    if bench_name == "ruler":
        try:
            from eval.metrics import ruler_score
        except ImportError:  # eval.metrics not available: RULER's rule, as BENCHMARKS.md states it
            return string_match(prediction, sample["answers"], part=sample["task"].startswith("qa"))
        return float(ruler_score(sample["task"], prediction, sample["answers"]))
    if bench_name == "niah":
        try:
            from eval.niah import niah_score
        except ImportError:
            return string_match(prediction, sample["answers"])
        return float(niah_score(prediction, sample["answers"]))
    return string_match(prediction, sample["answers"])  # toy


def string_match(prediction: str, answers: list[str], part: bool = False) -> float:
    """RULER's string_match_all (fraction of references contained, case-insensitive) or _part (any)."""
    text = "".join(ch for ch in prediction if ch.isprintable() or ch in "\n\t").lower()
    hits = [str(a).lower() in text for a in answers]
    if part:
        return 100.0 * any(hits)
    return 100.0 * sum(hits) / max(1, len(hits))


# --------------------------------------------------------------------------------------------- prompts
def encode_prompt(sample: Sample, tokenizer, context_only: bool) -> tuple[list[int], list[int]]:
    """Token ids of the prompt as (prefilled part, fed-after-compression part).

    The chat template wraps the user message (RULER: always; LongBench: per `use_chat_template`),
    then the answer prefix follows. With `context_only` the question (and everything after it) is
    the second part, fed uncompressed after the context has been compressed.
    """
    use_chat = sample.get("use_chat_template", True) and getattr(tokenizer, "chat_template", None)
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample["input"]}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = sample["input"]
    text += sample.get("answer_prefix") or ""
    split = len(text)
    if context_only and sample.get("question"):
        found = text.rfind(sample["question"])
        if found > 0:
            split = found
    head = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    tail = tokenizer(text[split:], add_special_tokens=False)["input_ids"] if split < len(text) else []
    return head, tail


# --------------------------------------------------------------------------------------------- decoding
class Evaluator:
    """Prefill once per sample, then compress + decode per (method, budget)."""

    def __init__(self, model, tokenizer, specs: tuple[MethodSpec, ...], bench_name: str, context_only: bool):
        from centroidkv import get_method

        self.model, self.tokenizer = model, tokenizer
        self.specs = specs
        self.methods = {spec: get_method(spec.name, **spec.params) for spec in specs}
        self.bench_name, self.context_only = bench_name, context_only
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
        )
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
        try:
            head, tail = encode_prompt(sample, self.tokenizer, self.context_only)
            base["context_length"] = len(head) + len(tail)
            prefilled = self.prefill(head, max_new, specs)
        except Exception as error:  # the sample is recorded as failed for every method, the job goes on
            _free_memory(self.device)
            for spec in specs:
                yield self.failed(base, spec, error)
            return
        eos = set() if ignore_eos else self.eos
        for spec in specs:
            try:
                result = self.decode(prefilled, spec, tail, max_new, eos)
            except Exception as error:
                _free_memory(self.device)
                yield self.failed(base, spec, error)
                continue
            generated = result.pop("generated")
            prediction = self.tokenizer.decode(generated, skip_special_tokens=True)
            record = {**base, **self.spec_fields(spec), "status": "ok", "prediction": prediction}
            record["score"] = score_sample(self.bench_name, sample, prediction)
            record["n_generated"] = len(generated)
            record.update(result)
            yield record

    def base_record(self, sample: Sample) -> dict:
        return {
            "benchmark": self.bench_name,
            "task": sample["task"],
            "length": sample.get("length"),
            "depth": sample.get("depth"),
            "sample_id": sample_id(sample),
            "references": sample.get("answers"),
            "protocol": "context_only" if self.context_only else "full_prompt",
            **({"source_length": sample["source_length"]} if "source_length" in sample else {}),
        }

    @staticmethod
    def spec_fields(spec: MethodSpec) -> dict:
        return {"method": spec.name, "params": dict(sorted(spec.params.items())), "budget": spec.budget}

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
    prefilled = evaluator.prefill(head, 4, specs)
    for spec in specs:
        try:
            evaluator.decode(prefilled, spec, [], 4)
        except Exception:  # a method that cannot run on a 200-token prompt will fail (and be recorded) later
            pass


# --------------------------------------------------------------------------------------------- job
class SetupError(RuntimeError):
    """The model or the samples could not be loaded (hub unreachable, data missing): nothing was written."""


def summarize(records: list[dict]) -> dict[str, Any]:
    """Mean score / TPOT / KV bytes per method@budget, plus counts."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups[f"{record['method']}@{record['budget']:g}"].append(record)
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
        samples = load_samples(cfg.benchmark, tokenizer)
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
    evaluator = Evaluator(model, tokenizer, cfg.methods, cfg.benchmark.name, cfg.benchmark.context_only)
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
    validated = json.loads(json.dumps(asdict(cfg), default=str))
    return OmegaConf.to_yaml(OmegaConf.create({"composed": resolved, "validated": validated}))
