"""Prefill once, then greedy-decode with any number of compressed forks of that prefill, timed.

`prefill` runs the prompt with a full cache (recording what query-aware methods need);
`generate_from` forks it with a (method, budget), compresses, optionally feeds more tokens with
compression paused (the question, in the context-only protocol), and decodes greedily.
TTFT = prefill + the fork's compression + the fed tokens; TPOT = mean time of the decode steps
after the first (the first step is a warm-up and is excluded when there are more).
Times come from CUDA events on a GPU and `perf_counter` on a CPU (`centroidkv.timing.Timer`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from centroidkv.attention import attention_modules
from centroidkv.cache import CompressedCache
from centroidkv.fork_batch import ForkBatch
from centroidkv.methods import Method
from centroidkv.needs import Need
from centroidkv.timing import Timer


@dataclass
class Prefill:
    cache: CompressedCache  # the full, uncompressed cache of the prompt (never modified)
    first_token: Tensor  # [B, 1], argmax after the prompt
    seconds: float  # the forward, without the taps' compressions
    tapped: dict[Hashable, Tapped] = field(default_factory=dict)  # what each tap compressed


@dataclass
class Generation:
    tokens: list[list[int]]  # generated ids per batch row (first token included, cut after an eos)
    ttft_s: float  # prefill + compression + fed tokens
    tpot_s: float  # mean decode step after the first (nan when there was no step)
    compress_s: float
    feed_s: float  # the tokens fed after compression (0 when none)
    decode_s: float  # all decode steps
    n_decode_steps: int
    kv_bytes_compressed: int  # right after compression (and the fed tokens)
    kv_bytes: int  # at the end of decoding
    kv_capacity_bytes: int  # at the end of decoding: the buffers behind kv_bytes, headroom included
    kv_ratio: float  # right after compression: bytes stored / bytes of the full cache of those tokens
    budget_ratio: float  # right after compression: bytes stored / bytes of a full cache of n + Gamma tokens
    seq_lengths: list[int]  # entries per layer at the end
    n_compressions: int
    # right after compression: bytes allocated (buffers with their decode headroom) / the budget's
    # reference, beside budget_ratio (the live entries); nan where not measured
    allocated_ratio: float = float("nan")


class PrefillTap(Protocol):
    """A method that compresses inside a prefill, run on a prefill shared with other methods.

    After each attention layer of the shared prefill, `after_layer` gets that layer's call (the
    attention module, its keyword arguments and output) with `cache`, this tap's own fork of the
    prefill's cache, whose layer `module.layer_idx` holds the layer's full keys and values (shared
    tensors: never write into them); it leaves its compressed layer in that fork. The prefill itself
    goes on with the full cache, so every tap sees exactly what it would see in a prefill of its own.
    """

    def after_layer(self, module: nn.Module, kwargs: dict, output: Any, cache: CompressedCache) -> None: ...


@dataclass
class Tapped:
    """What a `PrefillTap` left: its compressed fork, its compression time, or the error it raised."""

    cache: CompressedCache
    seconds: float = 0.0
    error: BaseException | None = None


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: Tensor,
    max_new_tokens: int,
    needs: Iterable[Need] = (),
    taps: Mapping[Hashable, PrefillTap] | None = None,
) -> Prefill:
    """Run the prompt once with a full cache that records `needs` (e.g. `needs_of(methods)`).

    `taps` compress their own forks during this one forward (`PrefillTap`), e.g. one per kvpress
    press and budget of a job; `Prefill.tapped` holds the results under the same keys. A tap that
    raises is stopped there (its error kept) and the others go on. `Prefill.seconds` excludes the
    taps' compression time, which each `Tapped.seconds` holds.
    """
    if input_ids.shape[-1] == 0:
        raise ValueError("prefill needs at least one prompt token, got an empty prompt")
    cache = CompressedCache("full", budget=1.0, max_new_tokens=max_new_tokens, needs=needs)
    tapped = {key: Tapped(CompressedCache("full", 1.0, max_new_tokens)) for key in taps or {}}

    def after_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layer = cache.layers[module.layer_idx]
        for key, tap in (taps or {}).items():
            fork = tapped[key]
            if fork.error is not None:
                continue
            fork.cache.n_layers, fork.cache.rotary, fork.cache.model_ref = (
                cache.n_layers,
                cache.rotary,
                cache.model_ref,
            )
            fork.cache.layers.append(layer.fork(fork.cache))
            start = time.perf_counter()
            try:
                tap.after_layer(module, kwargs, output, fork.cache)
            except Exception as error:  # this tap's run fails; the prefill and the other taps go on
                fork.error = error
            fork.seconds += time.perf_counter() - start

    hooks = (
        [m.register_forward_hook(after_attention, with_kwargs=True) for m in attention_modules(model)]
        if taps
        else []
    )
    try:
        with Timer(input_ids.device).span() as span:
            logits = model(input_ids, past_key_values=cache, logits_to_keep=1).logits
            first_token = logits[:, -1].argmax(-1, keepdim=True)
    finally:
        for hook in hooks:
            hook.remove()
    seconds = span.seconds - sum(fork.seconds for fork in tapped.values())
    return Prefill(cache, first_token, seconds, tapped)


def needs_of(methods: Iterable[Method]) -> list[Need]:
    """Everything a prefill must record so that it can be forked to each of `methods`."""
    return [need for method in methods for need in method.needs()]


def default_eos(model: PreTrainedModel) -> set[int]:
    configured = model.generation_config.eos_token_id
    return set(configured if isinstance(configured, list) else [] if configured is None else [configured])


@dataclass
class Fork:
    """A compressed fork of a prefill with its first token chosen: ready to decode (`decode_forks`)."""

    cache: CompressedCache
    token: Tensor  # [B, 1], the first generated token (after the prompt, or after the fed question)
    prefill_s: float
    compress_s: float
    feed_s: float
    kv_bytes_compressed: int  # right after compression (and the fed tokens)
    kv_ratio: float
    budget_ratio: float  # right after compression, before the fed tokens
    allocated_ratio: float = float("nan")  # the same moment: allocated bytes / the budget's reference


@torch.inference_mode()
def start_fork(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method | str,
    budget: float,
    max_new_tokens: int,
    question_ids: Tensor | None = None,
    budget_unit: str | None = None,
) -> Fork:
    """Fork `prefilled` with (method, budget), compress, and feed `question_ids` with compression
    paused; the first token follows the prompt (or the question). Raises now when `max_new_tokens`
    will need a compression whose budget cannot hold the protected tokens."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    timer = Timer(prefilled.first_token.device)
    with timer.span() as compressing:
        cache = prefilled.cache.fork(method, budget, max_new_tokens, budget_unit=budget_unit)
    budget_ratio = cache.budget_ratio()  # before the question: what the compression kept
    allocated_ratio = cache.allocated_ratio()
    token, feed_s = prefilled.first_token, 0.0
    if question_ids is not None and question_ids.shape[1]:
        with timer.span() as feeding, cache.paused():
            logits = model(question_ids, past_key_values=cache, logits_to_keep=1).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        feed_s = feeding.seconds
    cache.check_room(max_new_tokens - 1)  # a budget too small for the protected tokens fails before decoding
    return Fork(
        cache,
        token,
        prefilled.seconds,
        compressing.seconds,
        feed_s,
        cache.kv_bytes(),
        cache.kv_ratio(),
        budget_ratio,
        allocated_ratio,
    )


@torch.inference_mode()
def decode_forks(
    model: PreTrainedModel,
    forks: list[Fork],
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
) -> list[Generation]:
    """Decode `forks` greedily in lockstep, one `Generation` each; a fork stops at its end-of-sequence.

    One fork decodes alone (its batch rows in lockstep) and its steps are timed. Several forks (one
    row each, of one prefill) run as the rows of one batch (`centroidkv.fork_batch`): one weight pass
    per step for all of them, each row attending to its own fork's cache. Their steps are shared,
    so a batched fork reports no TPOT or decode time of its own (nan).
    """
    eos_token_ids = default_eos(model) if eos_token_ids is None else eos_token_ids
    if not forks:
        return []
    device = forks[0].token.device
    timer = Timer(device)
    eos = torch.tensor(sorted(eos_token_ids), device=device, dtype=forks[0].token.dtype)
    together = len(forks) > 1
    tokens = [fork.token for fork in forks]
    generated = [[token][:max_new_tokens] for token in tokens]  # max_new_tokens=0: no token at all
    step_times: list[list[float]] = [[] for _ in forks]
    finished = [torch.zeros(token.shape[0], dtype=torch.bool, device=device) for token in tokens]
    active = list(range(len(forks)))
    for _ in range(max_new_tokens - 1):
        for i in active:
            finished[i] |= torch.isin(tokens[i][:, 0], eos)
        active = [i for i in active if not bool(finished[i].all())]
        if not active:
            break
        with timer.span() as step:
            if together:
                cache = ForkBatch([forks[i].cache for i in active])
                batch_tokens = torch.cat([tokens[i] for i in active])
            else:
                cache, batch_tokens = forks[0].cache, tokens[0]
            logits = model(batch_tokens, past_key_values=cache, logits_to_keep=1).logits
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
        for row, i in enumerate(active):
            tokens[i] = next_tokens[row : row + 1] if together else next_tokens
            generated[i].append(tokens[i])
            step_times[i].append(step.seconds)
    return [
        _generation(fork, generated[i], step_times[i], eos_token_ids, timed=not together)
        for i, fork in enumerate(forks)
    ]


def _generation(
    fork: Fork, generated: list[Tensor], step_times: list[float], eos_token_ids: set[int], timed: bool
) -> Generation:
    rows = fork.token.shape[0]
    ids = torch.cat(generated, dim=1).tolist() if generated else [[] for _ in range(rows)]
    if eos_token_ids:  # cut each row after its first end-of-sequence token
        ids = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))] for row in ids]
    after_first = step_times[1:] or step_times  # the first step is a warm-up when there are more
    nan = float("nan")
    cache = fork.cache
    return Generation(
        tokens=ids,
        ttft_s=fork.prefill_s + fork.compress_s + fork.feed_s,
        tpot_s=sum(after_first) / len(after_first) if timed and after_first else nan,
        compress_s=fork.compress_s,
        feed_s=fork.feed_s,
        decode_s=sum(step_times) if timed else nan,
        n_decode_steps=len(step_times),
        kv_bytes_compressed=fork.kv_bytes_compressed,
        kv_bytes=cache.kv_bytes(),
        kv_capacity_bytes=cache.kv_capacity_bytes(),
        kv_ratio=fork.kv_ratio,
        budget_ratio=fork.budget_ratio,
        seq_lengths=cache.seq_lengths(),
        n_compressions=cache.n_compressions,
        allocated_ratio=fork.allocated_ratio,
    )


def generate_from(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method | str,
    budget: float,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    question_ids: Tensor | None = None,
    budget_unit: str | None = None,
) -> Generation:
    """Compress a fork of `prefilled` with (method, budget) and decode greedily, batch rows in lockstep.

    `question_ids` ([B, q]) are fed after compression with compression paused, and the first token
    follows them. `budget_unit`: "bytes" or "entries" (`centroidkv.budget`; None: the prefill
    cache's, the default unit). Decoding stops when every row has produced an end-of-sequence token:
    `eos_token_ids` (an empty set never stops), by default the model's generation config.
    """
    fork = start_fork(model, prefilled, method, budget, max_new_tokens, question_ids, budget_unit)
    return decode_forks(model, [fork], max_new_tokens, eos_token_ids)[0]


def own_prefill(
    model: PreTrainedModel, method: Method, budget: float, context_ids: Tensor, max_new_tokens: int
) -> Prefill:
    """The prefill of a method that compresses inside its own prefill forward (kvpress's presses,
    `method.compresses_in_prefill`): the context runs with the method's hooks active, so the returned
    cache is already compressed and the compression time is part of `Prefill.seconds`. Such a method
    cannot fork a shared prefill; continue with `generate_after_own_prefill`.
    (The budget's B is the same in both units: a press's cache stores keys and values only.)"""
    with method.prefill_hooks(model, budget, context_ids.shape[-1], max_new_tokens):
        return prefill(model, context_ids, max_new_tokens)


def generate_after_own_prefill(
    model: PreTrainedModel,
    prefilled: Prefill,
    method: Method,
    budget: float,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    question_ids: Tensor | None = None,
) -> Generation:
    """Feed the question and decode greedily on the cache `own_prefill` compressed, with the method's
    decoding hooks active (no fork, no further compression by the cache)."""
    with method.decoding_hooks(model, budget):
        return generate_from(
            model,
            prefilled,
            "full",
            1.0,
            max_new_tokens,
            eos_token_ids=eos_token_ids,
            question_ids=question_ids,
        )


def chat_text(tokenizer, user_message: str, answer_prefix: str = "", use_chat_template: bool = True) -> str:
    """The prompt as text: the chat template around `user_message` as the user's turn with the
    assistant's generation prompt (when the tokenizer has one and `use_chat_template`), then
    `answer_prefix`."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = user_message
    return text + (answer_prefix or "")


def chat_prompt_ids(
    tokenizer,
    user_message: str,
    question: str | None = None,
    context_only: bool = False,
    answer_prefix: str = "",
    use_chat_template: bool = True,
) -> tuple[list[int], list[int]]:
    """Token ids of a prompt as (the part to prefill, the part fed after compression).

    The chat template (when the tokenizer has one and `use_chat_template`) wraps `user_message` as
    the user's turn and adds the assistant's generation prompt; `answer_prefix` follows. With
    `context_only`, the text from the last occurrence of `question` on is the second part (the
    context-only protocol); otherwise the second part is empty (the full-prompt protocol).
    """
    text = chat_text(tokenizer, user_message, answer_prefix, use_chat_template)
    split = len(text)
    if context_only and question:
        found = text.rfind(question)
        if found > 0:
            split = found
    head = tokenizer(text[:split], add_special_tokens=False)["input_ids"]
    tail = tokenizer(text[split:], add_special_tokens=False)["input_ids"] if split < len(text) else []
    return head, tail


def warm_up(
    model: PreTrainedModel, methods: Iterable[Method | str] = ("centroidkv",), prompt_len: int = 256
) -> float:
    """Pay a process's one-time costs before timing anything: one tiny prefill, then a compressed
    fork + a few decode steps per method (default: CentroidKV, whose first compression in a process
    is several times slower than the next ones). Returns the seconds it took. The runner does the
    same per job (`warmup: true`)."""
    from centroidkv.methods import get_method  # the registry, at call time (methods may be added late)

    start = time.perf_counter()
    built = [get_method(m) if isinstance(m, str) else m for m in methods]
    device = next(model.parameters()).device
    ids = (torch.arange(prompt_len, device=device) % (model.config.vocab_size - 10) + 10)[None]
    shared = [m for m in built if not m.compresses_in_prefill]
    prefilled = prefill(model, ids, 4, needs=needs_of(shared))
    for method in built:
        if method.compresses_in_prefill:
            own = own_prefill(model, method, 0.5, ids, 4)
            generate_after_own_prefill(model, own, method, 0.5, 4, eos_token_ids=set())
        else:
            generate_from(model, prefilled, method, 0.5, 4, eos_token_ids=set())
    return time.perf_counter() - start
