"""One prompt through several methods: a context and a question in, one answer per method out.

    python -m centroidkv.generate --context essay.txt --question "What is the magic number?" \\
        --methods "full,centroidkv,snapkv(window_size=16)" --budget 0.25

The prompt goes through the model's chat template and every method runs through one per-prompt plan
(`centroidkv.plan.run`): the native methods fork one shared prefill, each compressing its fork to
the budget, and decode greedily one at a time (so each has its own TPOT). Every method of one call
runs the same protocol, named in the output's first line: with --context and --question, the
context is compressed and the question fed afterwards (context-only); --question may be given
several times, and then each method compresses the context once and answers every question from
that same compressed cache (as kvpress's pipeline does with `questions=[...]`); with --prompt, the
whole prompt is compressed (full-prompt), and a method that can only compress a context is refused
for that call with one line. Each method prints its block as soon as it is
done: the answer, the KV measured, the entries per layer and the times (after an untimed
`warm_up`, so the first compression of the process is not counted several times slower); a method
that cannot run prints one line and the others go on. Method parameters are set in the method's
name: `centroidkv(n_recent=32)`, or `name:value` for a method's shorthand parameter
(`centroidkv.methods.parse_method`). The same from Python: `generate(model, tokenizer, context,
question, methods, budget)`.

Every bad input (an unknown method or parameter, a missing file, a budget outside (0, 1], a prompt
and --max-new-tokens beyond the model's positions) is one line on stderr and exit status 2, before
the model loads, with the closest valid name where one is close; the method names, parameters and
their values, the model name and the budget are checked before torch is imported (in well under a
second) (`--truncate` cuts the middle of a context that is too long instead, as LongBench
does). A model that cannot be loaded (the Hub unreachable, a gated model) is one line and status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from centroidkv.budget import BUDGET_UNITS, DEFAULT_BUDGET_UNIT, check_budget, check_budget_unit
from centroidkv.errors import first_line
from centroidkv.files import file_problem, is_file, read_file_text
from centroidkv.hub_probe import offline_unless_reachable
from centroidkv.model_names import (
    EMBEDDED_MODEL,
    HUB_MODELS,
    MODEL_NAMES,
    RANDOM_MODELS,
    model_kind,
    parse_model_name,
)
from centroidkv.parsing import split_top_level
from centroidkv.prompt_fit import check_fits, prompt_length, truncate_context
from centroidkv.run_options import CONTEXT_ONLY, FULL_PROMPT, PROTOCOLS
from centroidkv.schema import check_method_spec, config_schema

# Torch and transformers (the model, the methods, the plan) are imported where they are needed, in
# the functions below: the command line checks its input first, so a bad one is one line in well
# under a second (`centroidkv.schema` knows the methods and their parameters' rules without torch).
if TYPE_CHECKING:
    from centroidkv.methods import Method
    from centroidkv.plan import Outcome, Prompt


@dataclass
class Answer:
    """One method's answer to the prompt, with what it kept and how long it took; or its error."""

    method: str  # as asked for, e.g. "snapkv" or "centroidkv(n_recent=32)"
    label: str  # its display label (tables and figures use the same)
    protocol: str  # full_prompt or context_only: the call's
    compresses: bool  # False for the full cache (no budget applies)
    question: str = ""  # the question this answers (one of the call's)
    error: str | None = None  # one line when the method could not run; every field below is then empty
    text: str = ""
    n_generated: int = 0
    # The measurements under their record names (`centroidkv.measurements`):
    kv_ratio: float | None = None  # bytes stored / bytes of a full cache of the same tokens
    kv_budget_ratio: float | None = None  # bytes after compression / a full cache of prompt + max new tokens
    kv_bytes: int | None = None  # what decoding started from
    min_entries: int = 0  # entries per layer at the end of decoding, smallest layer
    max_entries: int = 0  # ... largest layer
    ttft: float | None = None  # seconds: prefill + compression (+ the question fed after it)
    tpot: float | None = None  # seconds: mean decode step after the first; None when there was none
    prefill_s: float | None = (
        None  # the shared prefill (a method compressing in its own: compression included)
    )
    compress_s: float | None = None


def generate(
    model,
    tokenizer,
    context: str,
    question: str | Sequence[str] = "",
    methods: Sequence[str | Method] = ("full", "centroidkv"),
    budget: float = 0.25,
    max_new_tokens: int = 64,
    protocol: str | None = None,
    budget_unit: str = DEFAULT_BUDGET_UNIT,
    warm: bool = True,
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """Answer `question` about `context` with each of `methods` at `budget`: one `Answer` per method
    and question, method by method, each method's in the order of the questions.

    `question`: one, or several (each method then compresses the context once and answers every
    question from it). The user's turn is the context, a blank line and the question. `protocol`:
    "context_only" compresses the context and feeds the question afterwards (the default with a
    question); "full_prompt" compresses the whole prompt (the default without one; one question at
    most), which a method that compresses inside its prefill cannot run (it answers with its error).
    `warm`: `warm_up` first, keeping one-time costs out of the times; `on_answer(answer)` as soon as
    each is done. A method that fails answers with its error (one line); the others go on. ValueError
    (one line), before any prefill: a bad method, budget, unit or protocol, a prompt beyond the
    model's positions, or a head policy on a model not calibrated yet (`python -m eval.calibrate`).
    """
    from centroidkv.decoding import eos_token_ids
    from centroidkv.methods import parse_method
    from centroidkv.plan import Run, run, warm_up

    budget = check_budget(budget)
    check_budget_unit(budget_unit)
    questions, protocol = _questions_and_protocol(question, protocol)
    named = [(m, parse_method(m)) if isinstance(m, str) else (m.name, m) for m in methods]
    prompt = _prompt(tokenizer, context, questions, protocol)
    positions = getattr(model.config, "max_position_embeddings", None)
    for q in range(len(questions)):
        check_fits(len(prompt.prefilled) + len(prompt.fed_ids(q)), max_new_tokens, positions, "the model")
    for _, method in named:  # heads kept whole resolved before any forward (a missing file: one line)
        method.listed_heads(model)
    answers = _refused(named, protocol, questions[0])
    for answer in answers.values():
        if on_answer:
            on_answer(answer)
    runnable = [i for i in range(len(named)) if (i, 0) not in answers]
    if warm and runnable:
        warm_up(model, [named[i][1] for i in runnable])
    eos = eos_token_ids(model, tokenizer)

    def done(k: int, outcome: Outcome) -> None:
        i = runnable[k // prompt.n_questions]
        asked, method = named[i]
        answer = _outcome_answer(asked, method, outcome, tokenizer, questions[outcome.question])
        answers[i, outcome.question] = answer
        if on_answer:
            on_answer(answer)

    runs = [Run(named[i][1], budget if named[i][1].compresses else 1.0) for i in runnable]
    run(model, prompt, runs, max_new_tokens, eos, budget_unit, decode_batch=1, on_outcome=done)
    return [answers[key] for key in sorted(answers)]


def _questions_and_protocol(question: str | Sequence[str], protocol: str | None) -> tuple[list[str], str]:
    """The questions as a list and the protocol they run under (module docstring); ValueError (one
    line) for none, an unknown protocol, or several under the full-prompt protocol."""
    questions = [question] if isinstance(question, str) else list(question)
    if not questions:
        raise ValueError("give a question, or an empty one for a whole prompt")
    protocol = protocol or (CONTEXT_ONLY if any(questions) else FULL_PROMPT)
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if len(questions) > 1 and protocol != CONTEXT_ONLY:
        raise ValueError("several questions need the context-only protocol: one context, compressed once")
    return questions, protocol


def _refused(named: list[tuple[str, Method]], protocol: str, question: str) -> dict[tuple[int, int], Answer]:
    """The answers of the methods that cannot run `protocol` (keyed (method index, 0)): one that
    compresses inside its prefill cannot compress a whole prompt."""
    from centroidkv.plan import compresses_in_prefill

    if protocol != FULL_PROMPT:
        return {}
    error = (
        "{} compresses a context inside its prefill and cannot compress a whole prompt: "
        "give --context and --question (the context-only protocol)"
    )
    return {
        (i, 0): _answer(asked, method, protocol, question=question, error=error.format(asked))
        for i, (asked, method) in enumerate(named)
        if compresses_in_prefill(method)
    }


def _prompt(tokenizer, context: str, questions: list[str], protocol: str) -> Prompt:
    """The call's prompt: the chat of the context and the first question, split as `protocol`
    prefills and feeds it, and the other questions' turns (`Prompt.follow_ups`), each following the
    same context."""
    from centroidkv.decoding import chat_prompt_ids
    from centroidkv.plan import Prompt

    def split(question: str, context_only: bool) -> tuple[list[int], list[int]]:
        message = f"{context}\n\n{question}" if question else context
        return chat_prompt_ids(tokenizer, message, question, context_only=context_only)

    head, tail = split(questions[0], protocol == CONTEXT_ONLY)
    context_ids, question_ids = split(questions[0], True)
    follow_ups = []
    for question in questions[1:]:
        own_context, own_question = split(question, True)
        if own_context != context_ids:  # the chat template put the question inside the context's turn
            raise ValueError("the chat template splits this context differently for each question")
        follow_ups.append(own_question)
    return Prompt(head, tail, context_ids, question_ids, protocol, follow_ups=tuple(follow_ups))


def _answer(asked: str, method: Method, protocol: str, **fields) -> Answer:
    from centroidkv.methods import method_label

    label = method_label(method.name, method.params())  # with its precision (" @int8")
    return Answer(asked, label, protocol, method.compresses, **fields)


def _outcome_answer(asked: str, method: Method, outcome: Outcome, tokenizer, question: str) -> Answer:
    generation = outcome.generation
    if generation is None:
        error = outcome.error or RuntimeError("not decoded")
        return _answer(asked, method, outcome.protocol, question=question, error=first_line(error))
    measured = generation.measured
    return _answer(
        asked,
        method,
        outcome.protocol,
        question=question,
        text=tokenizer.decode(outcome.answer_ids, skip_special_tokens=True).strip(),
        n_generated=len(outcome.answer_ids),
        kv_ratio=measured["kv_ratio"],
        kv_budget_ratio=measured["kv_budget_ratio"],
        kv_bytes=measured["kv_bytes"],
        min_entries=min(generation.seq_lengths, default=0),
        max_entries=max(generation.seq_lengths, default=0),
        ttft=measured["ttft"],
        tpot=measured["tpot"],
        prefill_s=measured["prefill_s"],
        compress_s=measured["compress_s"],
    )


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m centroidkv.generate",
        description="Put one prompt through several KV-cache compression methods from one prefill.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"methods: {', '.join(config_schema()['methods'])}",
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
    from centroidkv.methods import parse_method

    for method in methods:
        parse_method(method)
    import centroidkv.models as models  # as models.<name>, so that tests can stand in for the loaders

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
    import centroidkv.models as models  # torch: only once the request is known to be good

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
