"""The command line of `centroidkv.plan.generate`: one prompt through several methods.

    python scripts/generate.py --context essay.txt --question "What is the magic number?" \\
        --methods "full,centroidkv,snapkv(window_size=16)" --budget 0.25

With --context and --question the context is compressed and the question fed afterwards
(context-only; --question may be given several times, each method then compresses the context once
and answers every question); with --prompt the whole prompt is compressed (full-prompt). Each method
prints its block as soon as it is done: the answer, the KV measured, the entries per layer and the
times; a method that cannot run prints one line and the others go on. The protocol is named in the
output's first line.

Every bad input (an unknown method or parameter, a missing file, a budget outside (0, 1], a prompt
and --max-new-tokens beyond the model's positions) is one line on stderr and exit status 2, before
the model loads, with the closest valid name where one is close: `checked_request` gathers every
check into one `Request`; the method names, parameters and their values, the model name and the
budget are checked before torch is imported (in well under a second) (`--truncate` cuts the middle
of a context that is too long instead, as LongBench does). A model that cannot be loaded (the Hub
unreachable, a gated model) is one line and status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from centroidkv.cache.budget import BUDGET_UNITS, DEFAULT_BUDGET_UNIT, check_budget  # noqa: E402
from centroidkv.errors import first_line  # noqa: E402
from centroidkv.files import file_problem, is_file, read_file_text  # noqa: E402
from centroidkv.models.hub_probe import offline_unless_reachable  # noqa: E402
from centroidkv.models.model_names import (  # noqa: E402
    EMBEDDED_MODEL,
    HUB_MODELS,
    MODEL_NAMES,
    RANDOM_MODELS,
    model_kind,
    parse_model_name,
)
from centroidkv.models.prompt_fit import check_fits, prompt_length, truncate_context  # noqa: E402
from centroidkv.parsing import split_top_level  # noqa: E402
from centroidkv.plan.generate import Answer, generate  # noqa: E402
from centroidkv.plan.run_options import CONTEXT_ONLY, FULL_PROMPT, PROTOCOLS  # noqa: E402
from centroidkv.schema import cached_schema, check_method_spec  # noqa: E402

# Torch and transformers (the model, the methods) are imported in the functions below, once the
# request is known to be good (`centroidkv.plan.generate` imports them only where it runs a prompt).


def protocol_line(protocol: str, budget: float, budget_unit: str, n_questions: int = 1) -> str:
    """The output's first line: what every method of the call did."""
    if protocol == FULL_PROMPT:
        what = "the whole prompt is compressed"
    elif n_questions == 1:
        what = "the context is compressed, then the question is fed"
    else:
        what = f"the context is compressed once per method, then each of the {n_questions} questions is fed"
    return f"protocol: {protocol} ({what}); budget {budget:g} in {budget_unit}"


def format_answer(answer: Answer, with_question: bool = False) -> str:
    """One method's block of the command's output (`with_question`: its question in the title, for
    a call with several)."""
    title = f"== {answer.method} ({answer.label})" + (f" · Q: {answer.question}" if with_question else "")
    if answer.error is not None:
        return f"{title}: cannot run: {answer.error}"
    tpot = "-" if answer.tpot is None else f"{answer.tpot * 1000:.0f} ms"
    entries = (
        f"{answer.min_entries}"
        if answer.min_entries == answer.max_entries
        else f"{answer.min_entries}-{answer.max_entries}"
    )
    mib = f"{answer.kv_bytes / 2**20:.1f} MiB"
    kv = (
        f"kv: {answer.kv_budget_ratio:.3f} of the budget's full cache (prompt + max new tokens), "
        f"{answer.kv_ratio:.3f} of a full cache of the same tokens, {mib}"
        if answer.compresses
        else f"kv: the full cache (no budget), {mib}"
    )
    return "\n".join(
        [
            title,
            f"answer: {answer.text}",
            f"{kv}; entries per layer: {entries}",
            f"time: ttft {answer.ttft:.2f} s (prefill {answer.prefill_s:.2f} s, compression "
            f"{answer.compress_s:.2f} s), tpot {tpot}, {answer.n_generated} tokens",
        ]
    )


def read_text(value: str, what: str) -> str:
    """`-` reads stdin; an existing file is read; anything else is an error (for --context)."""
    if value == "-":
        return sys.stdin.read()
    problem = file_problem(value)
    if problem is not None:
        raise ValueError(f"--{what}: {problem}")
    return read_file_text(value, f"--{what}")


def read_questions(values: list[str]) -> list[str]:
    """The --question values: each the text of the file it names (`is_file` cannot raise, so a long
    question is simply text), else the text itself; an empty one among several is refused by number."""
    questions = [read_file_text(q, "--question").strip() if q and is_file(q) else q for q in values]
    empty = [position for position, question in enumerate(questions, 1) if not question.strip()]
    if len(questions) > 1 and empty:
        raise ValueError(f"--question number {empty[0]} of {len(questions)} is empty: give each some text")
    return questions


def _methods_epilog() -> str:
    """The registered methods for --help, from the cached schema: --help never waits for torch (the
    first run with --methods builds and caches the schema)."""
    schema = cached_schema()
    if schema is None:
        return "methods: listed here once a run has checked --methods (which caches the method schema)"
    return f"methods: {', '.join(schema['methods'])}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python scripts/generate.py",
        description="Put one prompt through several KV-cache compression methods from one prefill.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=_methods_epilog(),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--context", help="the context: a file, or - for stdin")
    source.add_argument("--prompt", help="the whole prompt as text (no separate question)")
    parser.add_argument(
        "--question",
        action="append",
        default=[],
        help="the question: a file, or the text itself; give it several times to answer each question "
        "from the same compressed context (compressed once per method)",
    )
    parser.add_argument(
        "--methods",
        default="full,centroidkv",
        help="comma-separated methods (listed below); parameters in parentheses, "
        "e.g. 'centroidkv(n_recent=32),snapkv'; name:value sets a method's shorthand parameter",
    )
    parser.add_argument("--budget", type=float, default=0.25, help="R, a fraction in (0, 1]")
    parser.add_argument("--budget-unit", choices=BUDGET_UNITS, default=DEFAULT_BUDGET_UNIT)
    parser.add_argument(
        "--model",
        default=EMBEDDED_MODEL,
        help=f"one of {', '.join(MODEL_NAMES)} (random-*:N keeps N layers), a local folder saved with "
        "save_pretrained, a .gguf file or a Hugging Face id",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens per answer")
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default=None,
        help="default: context_only with --context and --question, full_prompt otherwise",
    )
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut the middle of a context too long for the model's positions (as LongBench does)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per method, one per line")
    args = parser.parse_args(argv)
    if args.protocol is None:
        args.protocol = CONTEXT_ONLY if args.context is not None and any(args.question) else FULL_PROMPT
    return args


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


@dataclass
class Request:
    """What a `generate` command line asks for, every value checked (`checked_request`)."""

    methods: list[str]
    budget: float
    context: str
    questions: list[str]
    positions: int | None  # the model's positions; None: a hub model not in the local cache


def checked_request(args: argparse.Namespace) -> Request:
    """The command line's request; ValueError (one line) for any bad value, before the model loads:
    first what needs no torch, then the methods themselves (head files, a press's own parameters)
    and the model's positions."""
    if model_kind(args.model) == "registered" and parse_model_name(args.model)[0] in RANDOM_MODELS:
        raise ValueError(f"model {args.model!r} has random weights and no tokenizer: choose a real model")
    methods = [m.strip() for m in split_top_level(args.methods) if m.strip()]
    if not methods:
        raise ValueError("--methods: give at least one method")
    for method in methods:  # names, parameters and their rules, from the cached schema
        check_method_spec(method)
    budget = check_budget(args.budget)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    context = args.prompt if args.prompt is not None else read_text(args.context, "context")
    questions = read_questions(args.question) or [""]
    if len(questions) > 1 and args.protocol != CONTEXT_ONLY:
        raise ValueError("several --question need --context and the context_only protocol")
    if not context.strip():
        raise ValueError("the context is empty")
    from centroidkv.head_policy import HeadPolicy
    from centroidkv.methods import parse_method

    for method in methods:  # a missing head calibration: before the model is installed or converted
        HeadPolicy.of(parse_method(method)).check_calibrated(args.model)
    import centroidkv.models.loading as models  # as models.<name>, so that tests can stand in for the loaders

    positions = models.max_positions(args.model)
    if positions is not None and args.max_new_tokens >= positions:
        raise ValueError(
            f"--max-new-tokens must be at least 1 and below {args.model}'s {positions} positions, "
            f"got {args.max_new_tokens}"
        )
    return Request(methods, budget, context, questions, positions)


def fit_request(args: argparse.Namespace, request: Request, tokenizer: Any, positions: int | None) -> None:
    """Fit the context to `positions` (cut with --truncate) for every question: the longest decides."""
    request.positions = positions
    if positions is not None:
        for question in request.questions:
            request.context = fitted_context(args, tokenizer, request.context, question, positions)


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): a bad value is one line and exit 2, a model that cannot
    be loaded one line and exit 1, both before anything runs."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        request = checked_request(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import centroidkv.models.loading as models  # torch: only once the request is known to be good

    if args.model in HUB_MODELS or model_kind(args.model) == "hub":
        offline_unless_reachable()  # offline when the Hub does not answer within seconds, not ~75 s
    try:
        tokenizer = models.load_tokenizer(args.model)
    except (RuntimeError, OSError, ImportError, ValueError) as error:
        print(f"error: cannot load the tokenizer of {args.model}: {first_line(error)}", file=sys.stderr)
        return 1
    try:  # the prompt must fit in the model's positions: checked before the model loads when known
        fit_request(args, request, tokenizer, request.positions)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        model, tokenizer = models.load_model(args.model)
    except (RuntimeError, OSError, ImportError, ValueError) as error:  # the Hub unreachable, gated, ...
        print(f"error: cannot load {args.model}: {first_line(error)}", file=sys.stderr)
        return 1
    try:
        answers = _run_request(args, request, model, tokenizer)
    except ValueError as error:  # e.g. a head policy on a model that was never calibrated
        print(f"error: {first_line(error)}", file=sys.stderr)
        return 2
    return 0 if any(answer.error is None for answer in answers) else 1


def _run_request(args: argparse.Namespace, request: Request, model: Any, tokenizer: Any) -> list[Answer]:
    """Every method's answers, each method's block printed as soon as it is done."""
    questions = request.questions

    def show(answer: Answer) -> None:
        if args.json:
            fields = {**asdict(answer), "budget": request.budget, "budget_unit": args.budget_unit}
            print(json.dumps(fields), flush=True)
        else:
            print(format_answer(answer, with_question=len(questions) > 1) + "\n", flush=True)

    if request.positions is None:  # a hub model whose config was not cached: its positions are known now
        fit_request(args, request, tokenizer, getattr(model.config, "max_position_embeddings", None))
    if not args.json:
        print(
            protocol_line(args.protocol, request.budget, args.budget_unit, len(questions)) + "\n", flush=True
        )
    return generate(
        model,
        tokenizer,
        request.context,
        questions if len(questions) > 1 else questions[0],
        request.methods,
        request.budget,
        max_new_tokens=args.max_new_tokens,
        protocol=args.protocol,
        budget_unit=args.budget_unit,
        on_answer=show,
    )


if __name__ == "__main__":
    raise SystemExit(main())
