"""One prompt through several methods: a context and a question in, one answer per method out.

    python -m centroidkv.generate --context essay.txt --question "What is the magic number?" \\
        --methods full,centroidkv,snapkv --budget 0.25

The prompt goes through the model's chat template and is prefilled once, recording what every
method needs (`needs_of`); each method then compresses a fork of that prefill to the budget and
decodes greedily (`centroidkv.decoding`). A method that compresses inside its own prefill (a kvpress
press, `kvpress:<PressClass>`) gets a prefill of its own and always runs context-only. Each method
prints one block: the answer, the KV ratio measured, the entries per layer and the times (after an
untimed `warm_up`, so the first compression of the process is not counted several times slower).
The same from Python: `generate(model, tokenizer, context, question, methods, budget)`.

Every bad input (an unknown method, a missing file, a budget outside (0, 1], a prompt and
--max-new-tokens beyond the model's positions) is one line on stderr and exit status 2, before the
model loads (`--truncate` cuts the middle of a context that is too long instead, as LongBench does).
A model that cannot be loaded (the Hub unreachable, a gated model) is one line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import centroidkv.models as models  # used as models.<name>, so that tests can stand in for the loaders
from centroidkv.budget import BUDGET_UNITS, DEFAULT_BUDGET_UNIT, check_budget_unit
from centroidkv.decoding import (
    chat_prompt_ids,
    default_eos,
    generate_after_own_prefill,
    generate_from,
    needs_of,
    own_prefill,
    prefill,
    warm_up,
)
from centroidkv.errors import first_line
from centroidkv.methods import Method, get_method, method_label
from centroidkv.model_names import EMBEDDED_MODEL

PROTOCOLS = ("full_prompt", "context_only")
KVPRESS_PREFIX = "kvpress:"  # kvpress:SnapKVPress is get_method("kvpress", press="SnapKVPress")


@dataclass
class Answer:
    """One method's answer to the prompt, with what it kept and how long it took."""

    method: str  # as asked for, e.g. "snapkv" or "kvpress:SnapKVPress"
    label: str  # its display label (tables and figures use the same)
    text: str
    n_generated: int
    protocol: str  # full_prompt or context_only (a press always runs context-only)
    kv_ratio: float  # bytes stored / bytes of a full cache of the same tokens, right after compression
    budget_ratio: float  # bytes stored / bytes of a full cache of prompt + max_new_tokens (R in bytes)
    kv_bytes: int  # right after compression
    min_entries: int  # entries per layer at the end of decoding, smallest layer
    max_entries: int  # ... largest layer
    ttft_s: float  # prefill + compression (+ the question fed after it)
    tpot_s: float | None  # mean decode step after the first; None when there was none
    prefill_s: float  # the shared prefill (a press: its own, compression included)
    compress_s: float


def parse_method(spec: str) -> Method:
    """A method from its command-line name: a registered name, or `kvpress:<PressClass>`."""
    spec = spec.strip()
    if spec.startswith(KVPRESS_PREFIX):
        return get_method("kvpress", press=spec.removeprefix(KVPRESS_PREFIX))
    return get_method(spec)


def check_budget(budget: float) -> float:
    """The budget R as a float; ValueError (one line) unless it is a fraction in (0, 1]."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or math.isnan(budget):
        raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
    return float(budget)


def prompt_length(tokenizer, context: str, question: str, protocol: str) -> int:
    """The prompt's tokens, the chat template included (what the model's positions must hold besides
    the new tokens), whichever way the protocol splits them."""
    message = f"{context}\n\n{question}" if question else context
    head, tail = chat_prompt_ids(tokenizer, message, question, context_only=protocol == "context_only")
    return len(head) + len(tail)


def check_fits(n_prompt: int, max_new_tokens: int, positions: int | None, model_name: str) -> None:
    """ValueError (one line) unless the prompt and the new tokens fit in the model's positions."""
    if positions is not None and n_prompt + max_new_tokens > positions:
        raise ValueError(
            f"the prompt ({n_prompt} tokens) and --max-new-tokens ({max_new_tokens}) need "
            f"{n_prompt + max_new_tokens} positions, more than {model_name}'s {positions}: shorten the "
            "context, lower --max-new-tokens, or pass --truncate to cut the middle of the context"
        )


def truncate_context(
    tokenizer, context: str, question: str, protocol: str, max_new_tokens: int, positions: int
) -> str:
    """`context` with its middle cut (its first and last tokens kept, as LongBench truncates) so that
    the prompt and `max_new_tokens` fit in `positions`; unchanged when they already do."""
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    keep = len(ids)
    for _ in range(8):  # decoding and encoding again may change a few tokens at the cut
        excess = prompt_length(tokenizer, context, question, protocol) + max_new_tokens - positions
        if excess <= 0:
            return context
        keep -= excess
        if keep < 2:
            raise ValueError(
                f"the question, the chat template and --max-new-tokens ({max_new_tokens}) alone need "
                f"more than the model's {positions} positions"
            )
        half = keep // 2
        context = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[len(ids) - (keep - half) :], skip_special_tokens=True
        )
    raise ValueError(f"the context could not be cut to fit the model's {positions} positions")


def eos_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's."""
    eos = getattr(tokenizer, "eos_token_id", None)
    found = [*(eos if isinstance(eos, list) else [eos]), *default_eos(model)]
    return {int(e) for e in found if e is not None}


def generate(
    model,
    tokenizer,
    context: str,
    question: str = "",
    methods: Sequence[str | Method] = ("full", "centroidkv"),
    budget: float = 0.25,
    max_new_tokens: int = 64,
    protocol: str = "full_prompt",
    budget_unit: str = DEFAULT_BUDGET_UNIT,
    warm: bool = True,
) -> list[Answer]:
    """Answer `question` about `context` with each of `methods` at `budget`, from one shared prefill.

    The user's turn is the context, a blank line and the question (just the context when the
    question is empty). `protocol`: "full_prompt" compresses the whole prompt, "context_only" only
    the context and feeds the question afterwards (kvpress's protocol; presses always use it).
    `warm`: first run `warm_up` with the methods, so that a process's one-time costs (the first
    compression is several times slower) stay out of the times.
    Raises ValueError (one line) for a bad method, budget, unit or protocol, for a prompt and
    `max_new_tokens` beyond the model's positions (`max_position_embeddings`), or for a head policy
    on a model not calibrated yet (`python -m eval.calibrate`); all before any prefill.
    """
    budget = check_budget(budget)
    check_budget_unit(budget_unit)
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    named = [
        (m if isinstance(m, str) else m.name, parse_method(m) if isinstance(m, str) else m) for m in methods
    ]
    message = f"{context}\n\n{question}" if question else context
    device = next(model.parameters()).device

    def ids(tokens: list[int]) -> torch.Tensor | None:
        return torch.tensor([tokens], device=device) if tokens else None

    head, tail = chat_prompt_ids(tokenizer, message, question, context_only=protocol == "context_only")
    own_head, own_tail = chat_prompt_ids(tokenizer, message, question, context_only=True)
    positions = getattr(model.config, "max_position_embeddings", None)
    check_fits(len(head) + len(tail), max_new_tokens, positions, "the model")
    eos = eos_ids(model, tokenizer)
    for _, method in named:  # heads kept whole resolved before any forward (a missing file: one line)
        method.listed_heads(model)
    if warm:
        warm_up(model, [method for _, method in named])
    shared = [method for _, method in named if not method.compresses_in_prefill]
    prefilled = prefill(model, ids(head), max_new_tokens, needs=needs_of(shared)) if shared else None
    answers = []
    for asked, method in named:
        if method.compresses_in_prefill:
            own = own_prefill(model, method, budget, ids(own_head), max_new_tokens)
            result = generate_after_own_prefill(
                model, own, method, budget, max_new_tokens, eos_token_ids=eos, question_ids=ids(own_tail)
            )
            prefill_s, run_protocol = own.seconds, "context_only"
        else:
            result = generate_from(
                model,
                prefilled,
                method,
                budget,
                max_new_tokens,
                eos_token_ids=eos,
                question_ids=ids(tail),
                budget_unit=budget_unit,
            )
            prefill_s, run_protocol = prefilled.seconds, protocol
        tokens = result.tokens[0]
        if tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        answers.append(
            Answer(
                method=asked,
                label=method_label(method.name, method.params()),  # with its precision (" @int8")
                text=tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                n_generated=len(tokens),
                protocol=run_protocol,
                kv_ratio=result.kv_ratio,
                budget_ratio=result.budget_ratio,
                kv_bytes=result.kv_bytes_compressed,
                min_entries=min(result.seq_lengths, default=0),
                max_entries=max(result.seq_lengths, default=0),
                ttft_s=result.ttft_s,
                tpot_s=None if math.isnan(result.tpot_s) else result.tpot_s,
                prefill_s=prefill_s,
                compress_s=result.compress_s,
            )
        )
    return answers


def format_answer(answer: Answer, budget: float, budget_unit: str) -> str:
    """One method's block of the command's output."""
    tpot = "-" if answer.tpot_s is None else f"{answer.tpot_s * 1000:.0f} ms"
    entries = (
        f"{answer.min_entries}"
        if answer.min_entries == answer.max_entries
        else f"{answer.min_entries}-{answer.max_entries}"
    )
    return "\n".join(
        [
            f"== {answer.method} ({answer.label}), budget {budget:g} in {budget_unit}, {answer.protocol}",
            f"answer: {answer.text}",
            f"kv: {answer.budget_ratio:.3f} of the budget's full cache (prompt + max new tokens), "
            f"{answer.kv_ratio:.3f} of a full cache of the same tokens, {answer.kv_bytes / 2**20:.1f} MiB; "
            f"entries per layer: {entries}",
            f"time: ttft {answer.ttft_s:.2f} s (prefill {answer.prefill_s:.2f} s, compression "
            f"{answer.compress_s:.2f} s), tpot {tpot}, {answer.n_generated} tokens",
        ]
    )


def read_text(value: str, what: str) -> str:
    """`-` reads stdin; an existing file is read; anything else is an error (for --context)."""
    if value == "-":
        return sys.stdin.read()
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--{what}: no such file: {value}")
    return path.read_text()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m centroidkv.generate",
        description="Put one prompt through several KV-cache compression methods from one prefill.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--context", help="the context: a file, or - for stdin")
    source.add_argument("--prompt", help="the whole prompt as text (no separate question)")
    parser.add_argument("--question", default="", help="the question: a file, or the text itself")
    parser.add_argument(
        "--methods",
        default="full,centroidkv",
        help="comma-separated method names (method_names()), or kvpress:<PressClass>",
    )
    parser.add_argument("--budget", type=float, default=0.25, help="R, a fraction in (0, 1]")
    parser.add_argument("--budget-unit", choices=BUDGET_UNITS, default=DEFAULT_BUDGET_UNIT)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--protocol", choices=PROTOCOLS, default="full_prompt")
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut the middle of a context too long for the model's positions (as LongBench does)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per method, one per line")
    return parser.parse_args(argv)


def fitted_context(args: argparse.Namespace, tokenizer, context: str, question: str, positions: int) -> str:
    """The context, cut in the middle when --truncate asks and it is too long; ValueError (one line)
    when the prompt and --max-new-tokens do not fit in the model's `positions`."""
    if args.truncate:
        context = truncate_context(
            tokenizer, context, question, args.protocol, args.max_new_tokens, positions
        )
    check_fits(
        prompt_length(tokenizer, context, question, args.protocol), args.max_new_tokens, positions, args.model
    )
    return context


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:  # every input is checked before the model loads
        if models.parse_model_name(args.model)[0] in models.RANDOM_MODELS:
            raise ValueError(f"model {args.model!r} has random weights and no tokenizer: choose a real model")
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise ValueError("--methods: give at least one method")
        for method in methods:
            parse_method(method)
        budget = check_budget(args.budget)
        positions = models.max_positions(args.model)  # None: a hub model not in the local cache
        if args.max_new_tokens < 1 or (positions is not None and args.max_new_tokens >= positions):
            most = f" and below {args.model}'s {positions} positions" if positions is not None else ""
            raise ValueError(f"--max-new-tokens must be at least 1{most}, got {args.max_new_tokens}")
        context = args.prompt if args.prompt is not None else read_text(args.context, "context")
        question = args.question
        if question and Path(question).is_file():
            question = Path(question).read_text().strip()
        if not context.strip():
            raise ValueError("the context is empty")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        tokenizer = models.load_tokenizer(args.model)
    except (RuntimeError, OSError, ImportError, ValueError) as error:
        print(f"error: cannot load the tokenizer of {args.model}: {first_line(error)}", file=sys.stderr)
        return 1
    try:  # the prompt must fit in the model's positions: checked before the model loads when known
        if positions is not None:
            context = fitted_context(args, tokenizer, context, question, positions)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        model, tokenizer = models.load_model(args.model)
    except (RuntimeError, OSError, ImportError, ValueError) as error:  # the Hub unreachable, gated, ...
        print(f"error: cannot load {args.model}: {first_line(error)}", file=sys.stderr)
        return 1
    try:
        if positions is None:  # a hub model whose config was not cached: its positions are known now
            positions = getattr(model.config, "max_position_embeddings", None)
            if positions is not None:
                context = fitted_context(args, tokenizer, context, question, positions)
        answers = generate(
            model,
            tokenizer,
            context,
            question,
            methods,
            budget,
            max_new_tokens=args.max_new_tokens,
            protocol=args.protocol,
            budget_unit=args.budget_unit,
        )
    except ValueError as error:  # e.g. a budget too small for the method's protected tokens
        print(f"error: {first_line(error)}", file=sys.stderr)
        return 2
    for answer in answers:
        if args.json:
            print(json.dumps({**asdict(answer), "budget": budget, "budget_unit": args.budget_unit}))
        else:
            print(format_answer(answer, budget, args.budget_unit) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
