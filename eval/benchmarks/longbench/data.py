"""LongBench v1 / LongBench-E samples, from a local folder of jsonl files or from the Hugging Face Hub.

Prompt building follows THUDM/LongBench `LongBench/pred.py`: the dataset's template filled with the
row's `context` and `input`; a prompt longer than `max_length` tokens keeps its first and last
`max_length // 2` tokens (middle truncation, decoded without special tokens); the chat template is
skipped for trec, triviaqa, samsum, lsht, lcc and repobench-p.

The hub dataset `THUDM/LongBench` is a script dataset, which `datasets` >= 4 no longer runs; its files
come in `data.zip` (data/<dataset>.jsonl), which is fetched with `huggingface_hub` and read directly.
"""

from __future__ import annotations

import io
import json
import string
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

from centroidkv.errors import first_line
from eval.benchmarks.longbench.constants import (
    ALL_DATASETS,
    DEFAULT_MAX_LENGTH,
    E_DATASETS,
    HUB_REPO,
    MAX_NEW_TOKENS,
    NO_CHAT_TEMPLATE,
    PROMPTS,
)
from eval.common import Tokenizer, count_tokens, quiet_hub, read_jsonl, resolve_tokenizer


def file_name(dataset: str, e: bool = False) -> str:
    """The data file stem of a dataset: "<dataset>" or, for LongBench-E, "<dataset>_e"."""
    base = dataset[:-2] if dataset.endswith("_e") else dataset
    e = e or dataset.endswith("_e")
    if base not in ALL_DATASETS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; choose one of: {', '.join(ALL_DATASETS)}")
    if e and base not in E_DATASETS:
        raise ValueError(f"{base!r} is not in LongBench-E; its datasets are: {', '.join(E_DATASETS)}")
    return f"{base}_e" if e else base


@cache
def _hub_zip() -> bytes:
    with quiet_hub():
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(HUB_REPO, "data.zip", repo_type="dataset")
        except Exception as error:  # offline, unreachable, gated: one line for all
            raise RuntimeError(
                f"LongBench data needs the Hugging Face Hub dataset {HUB_REPO!r} (or pass data_dir= with "
                f"<dataset>.jsonl files), which could not be loaded: {first_line(error, with_type=True)}"
            ) from None
    return Path(path).read_bytes()


def source_of(dataset: str, data_dir: str | Path | None = None, e: bool = False) -> str:
    """Where a dataset's rows are read: the file under `data_dir`, or the file inside the hub's zip."""
    name = file_name(dataset, e)
    return str(Path(data_dir) / f"{name}.jsonl") if data_dir is not None else f"{HUB_REPO} data/{name}.jsonl"


def load_rows(dataset: str, data_dir: str | Path | None = None, e: bool = False) -> list[dict[str, Any]]:
    """The raw rows of a dataset: `<data_dir>/<name>.jsonl`, or the hub's data.zip when data_dir is None.
    A line that is not JSON is a ValueError naming the file and the line."""
    name = file_name(dataset, e)
    source = source_of(dataset, data_dir, e)
    if data_dir is not None:
        path = Path(data_dir) / f"{name}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"no LongBench file {path}")
        try:
            return read_jsonl(path)
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{source}: not a jsonl file: {first_line(error, with_type=True)}") from None
    with zipfile.ZipFile(io.BytesIO(_hub_zip())) as archive:
        with archive.open(f"data/{name}.jsonl") as f:
            return [json.loads(line) for line in io.TextIOWrapper(f, encoding="utf-8") if line.strip()]


def row_fields(dataset: str) -> tuple[str, ...]:
    """The fields a row of `dataset` needs: its prompt's placeholders (context, input) and answers."""
    base = dataset.removesuffix("_e")
    names = [field for _, field, _, _ in string.Formatter().parse(PROMPTS[base]) if field]
    return (*dict.fromkeys(names), "answers")


def row_problem(row: Any, dataset: str) -> str | None:
    """Why `row` cannot be a sample of `dataset` (not an object, a field missing, answers not a list
    of strings), or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    missing = [field for field in row_fields(dataset) if field not in row]
    if missing:
        return f"no field {', '.join(map(repr, missing))} (a row of {dataset} has {', '.join(row_fields(dataset))})"
    answers = row["answers"]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        return f"'answers' must be a list of strings, got {answers!r:.60}"
    return None


def check_rows(rows: list[Any], dataset: str, source: str) -> None:
    """Raise ValueError (one line naming `source`, the row and the field) for the first bad row."""
    for number, row in enumerate(rows, start=1):
        problem = row_problem(row, dataset)
        if problem is not None:
            raise ValueError(f"{source}: row {number}: {problem}")


def truncate_middle(prompt: str, tokenizer: Tokenizer, max_length: int) -> tuple[str, bool]:
    """LongBench's middle truncation: keep the first and last `int(max_length / 2)` tokens.

    Tokens are counted as the reference does (the tokenizer's default special tokens included).
    """
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt, False
    half = int(max_length / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, True


def load_samples(
    dataset: str,
    tokenizer: Tokenizer | str,
    data_dir: str | Path | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    n: int | None = None,
    e: bool = False,
) -> list[dict[str, Any]]:
    """LongBench samples of `dataset` (the first `n` rows when n is given), prompts built and truncated.

    Each sample has RULER's keys (task, index, input = context + question, context, question,
    answer_prefix = "", answers, max_new_tokens) plus dataset, all_classes, length (the dataset's own
    length field: words, or characters for Chinese; it sets the LongBench-E bucket), input_tokens,
    truncated, use_chat_template, language and _id.
    """
    name = file_name(dataset, e)
    base = name[:-2] if name.endswith("_e") else name
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    rows = load_rows(dataset, data_dir, e)
    rows = rows[:n] if n is not None else rows
    check_rows(rows, base, source_of(dataset, data_dir, e))
    tok = resolve_tokenizer(tokenizer)
    template = PROMPTS[base]
    head, tail = template.split("{context}")
    samples = []
    for index, row in enumerate(rows):
        prompt, truncated = truncate_middle(template.format(**row), tok, max_length)
        question = tail.format(**row)
        if question and prompt.endswith(question):
            context = prompt[: len(prompt) - len(question)]
        else:  # the question itself was cut by the truncation (only when max_length is tiny)
            context, question = prompt, ""
        samples.append(
            {
                "task": name,
                "index": index,
                "input": prompt,
                "context": context,
                "question": question,
                "answer_prefix": "",
                "answers": list(row["answers"]),
                "max_new_tokens": MAX_NEW_TOKENS[base],
                "dataset": base,
                "all_classes": row.get("all_classes"),
                "length": row.get("length"),
                "input_tokens": count_tokens(tok, prompt),
                "truncated": truncated,
                "use_chat_template": base not in NO_CHAT_TEMPLATE,
                "language": row.get("language"),
                "_id": row.get("_id"),
            }
        )
    return samples
