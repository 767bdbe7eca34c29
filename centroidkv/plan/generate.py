"""One prompt through several methods: a context and one or several questions in, one answer per method
(and question) out: `generate(model, tokenizer, context, question, methods, budget)`. The command
line around it is `scripts/generate.py`.

The prompt goes through the model's chat template and every method runs through one per-prompt plan
(`centroidkv.plan.plan.run`): the native methods fork one shared prefill, each compressing its fork to
the budget, and decode greedily one at a time (so each has its own TPOT). Every method of one call
runs the same protocol: with a context and a question the context is compressed and the question
fed afterwards (context-only); with several questions each method compresses the context once and
answers every question from that same compressed cache (as kvpress's pipeline does with
`questions=[...]`); with a whole prompt (`protocol="full_prompt"`), the whole prompt is compressed,
and a method that can only compress a context is refused for that call with an `Answer` whose
`error` says why. Each answer comes to `on_answer` as soon as it is done (after an untimed
`warm_up`, so the first compression of the process is not counted several times slower). Method
parameters are set in the method's name: `centroidkv(n_recent=32)`, or `name:value` for a method's
shorthand parameter (`centroidkv.methods.parse_method`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from centroidkv.cache.budget import DEFAULT_BUDGET_UNIT, check_budget, check_budget_unit
from centroidkv.errors import first_line
from centroidkv.models.prompt_fit import check_fits
from centroidkv.plan.run_options import CONTEXT_ONLY, FULL_PROMPT, PROTOCOLS

# Torch and transformers (the model, the methods, the plan) are imported where they are needed, in
# the functions below: the command line (scripts/generate.py) checks its input first, so a bad one is
# one line in well under a second (`centroidkv.schema` knows the methods and their parameters' rules
# without torch).
if TYPE_CHECKING:
    from centroidkv.methods import Method
    from centroidkv.plan.plan import Outcome, Prompt


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
    # The measurements under their record names (`centroidkv.plan.measurements`):
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
    from centroidkv.methods import HeadPolicy, parse_method
    from centroidkv.plan.decoding import eos_token_ids
    from centroidkv.plan.plan import Run, run, warm_up

    budget = check_budget(budget)
    check_budget_unit(budget_unit)
    questions, protocol = _questions_and_protocol(question, protocol)
    named = [(m, parse_method(m)) if isinstance(m, str) else (m.name, m) for m in methods]
    prompt = _prompt(tokenizer, context, questions, protocol)
    positions = getattr(model.config, "max_position_embeddings", None)
    for q in range(len(questions)):
        check_fits(len(prompt.prefilled) + len(prompt.fed_ids(q)), max_new_tokens, positions, "the model")
    for _, method in named:  # heads kept whole resolved before any forward (a missing file: one line)
        HeadPolicy.of(method).listed_heads(model)
    answers = _refused(named, protocol, questions[0])
    for answer in answers.values():
        if on_answer:
            on_answer(answer)
    runnable = [i for i in range(len(named)) if (i, 0) not in answers]
    if warm and runnable:
        warm_up(model, [named[i][1] for i in runnable], budget, budget_unit)
    eos = eos_token_ids(model, tokenizer)

    def done(k: int, outcome: Outcome) -> None:
        i = runnable[k // prompt.n_questions]
        asked, method = named[i]
        answer = _outcome_answer(asked, method, outcome, tokenizer, questions[outcome.question])
        answers[i, outcome.question] = answer
        if on_answer:
            on_answer(answer)

    runs = [Run.at(named[i][1], budget) for i in runnable]
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
    from centroidkv.plan.prefill_compressor import compresses_in_prefill

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
    from centroidkv.models.chat import chat_prompt_ids
    from centroidkv.plan.plan import Prompt

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


if __name__ == "__main__":
    raise SystemExit("the command line is scripts/generate.py: python scripts/generate.py --help")
