"""Head files: a calibrated score for every (layer, KV head) pair, and the heads a head policy lists.

A head policy (`centroidkv.head_policy`) lists the worst `fraction` of all (layer, KV head) pairs by a score
measured by `centroidkv.head_scores.calibrate_heads` on token windows the caller gives: prefill each window with a full
cache, shrink it to a budget, and compare each KV head's attention output for the last 64 queries (its
query heads, the degree-aware attention, causal) against the full cache's: relative L2 error
||o_compressed - o_full|| / ||o_full||, averaged over the windows. The last queries are what the next
tokens see, the heads' output (not their keys) is what the model consumes, and relative error compares
heads of different output scale. Two ways to shrink give two scores (`HEAD_SCORES`), a third reads
the attention itself:

  needle:     the attention mass the last queries (the question) put on the answer's tokens in the
              context, per head, on prompts with needles (the retrieval heads of Wu et al., "Retrieval
              Head Mechanistically Explains Long-Context Factuality", 2024); independent of any method;
  streaming:  keep the first STREAMING_SINKS tokens and a recent window (DuoAttention's criterion: the
              heads that need more than a streaming window; independent of any compression method);
  clustering: Chunked Soft Matching with CentroidKV's defaults (the paper's outlier heads, ~4 % of the
              heads that clustering damages most).

This module reads and writes the files (light: no model, no cache); the measurements are in
`centroidkv.head_scores`. The library holds no text: the harness's command (`python -m eval.calibrate --model NAME --score S`)
feeds it windows of the dev essays and writes the JSON (model, score, budget, fraction, per-head
errors, the list) to `<cache dir>/outlier_heads/<model>[.streaming].json` (`$CENTROIDKV_CACHE`, else
~/.cache/centroidkv; a cut random model's file is `<model>-<N>layers...`). `heads_file=<score>` reads
that file before the one shipped in the package (`centroidkv/data/`, the embedded model's), and names
the file it read, with its content hash, in the job's identity and every record. A model without
either file is refused with one line (`CalibrationMissing`): reading the heads never loads a
tokenizer or runs a prefill.
"""

from __future__ import annotations

# Light imports only: `python -m eval.calibrate --help` imports this module and must not wait for
# torch. Everything heavy (torch, tqdm, the models, the cache) is imported inside the functions that
# use it.
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from centroidkv.files import is_file, read_file_text, write_atomic
from centroidkv.parsing import is_number

if TYPE_CHECKING:
    pass

PACKAGED_DIR = Path(__file__).parent / "data"
FIELDS = ("model", "budget", "fraction", "n_layers", "n_kv_heads", "errors", "outliers")
HEAD_SCORES = ("needle", "streaming", "clustering")
STREAMING_SINKS = 4  # the streaming score's sinks (StreamingLLM's paper)
# The file-name suffix of each score's file: the clustering score keeps the name it always had.
SCORE_SUFFIX = {"clustering": "", "streaming": ".streaming", "needle": ".needle"}


def head_file_key(model_name: str) -> str:
    """The file-name stem of a model's head files: a registered model's canonical name, a depth
    written `-<N>layers` (`random-llama3.1-8b:2` -> `random-llama3.1-8b-2layers`) so that two depths of
    one model never share a file; a folder, .gguf file or hub id by its identity (its last part and a
    hash of its place and configuration: `centroidkv.models.model_names.model_identity`). A name only the
    user's code knows (`prepare_model(model, "mine")`) is kept, its `/` written `--`."""
    from centroidkv.models.model_specs import head_file_identity_of

    try:
        name = head_file_identity_of(model_name)
    except ValueError:
        name = model_name
    base, colon, depth = name.partition(":")
    if colon and depth.isdigit():  # a paper-shaped model cut to its first `depth` layers
        return f"{base}-{depth}layers"
    return name.replace("/", "--")


def user_head_dir() -> Path:
    """Where user calibrations live: `<cache dir>/outlier_heads` (`$CENTROIDKV_CACHE`)."""
    from centroidkv.models.model_names import cache_dir

    return cache_dir() / "outlier_heads"


def check_score(score: str) -> None:
    if score not in HEAD_SCORES:
        raise ValueError(f"head score must be one of {', '.join(HEAD_SCORES)}, got {score!r}")


def user_head_file(model_name: str, score: str = "clustering") -> Path:
    """The user's calibration of `model_name` by `score`: `<cache dir>/outlier_heads/<key>[suffix].json`."""
    check_score(score)
    return user_head_dir() / f"{head_file_key(model_name)}{SCORE_SUFFIX[score]}.json"


def packaged_head_file(model_name: str, score: str = "clustering") -> Path:
    """The calibration of `model_name` by `score` shipped in the package (the embedded model's)."""
    check_score(score)
    return PACKAGED_DIR / f"outlier_heads_{head_file_key(model_name)}{SCORE_SUFFIX[score]}.json"


def head_file_for(model_name: str, score: str = "clustering") -> Path | None:
    """The head file `heads_file=<score>` reads for `model_name`: the user's calibration, else the one
    shipped in the package, else None (not calibrated yet)."""
    candidates = (user_head_file(model_name, score), packaged_head_file(model_name, score))
    return next((p for p in candidates if is_file(p)), None)


NOT_CALIBRATED = "(not calibrated yet)"  # how an identity names a head file this machine lacks


def head_file_identity(path: Path) -> str:
    """`<file> sha256:<12 hex digits>`: which head file a run reads and what it holds, for job
    identities and records ("not calibrated yet" for the file `auto` asks the harness to calibrate).
    The package's file is named `centroidkv/data/...` and the user cache's `<cache>/outlier_heads/...`,
    so a job resumed on another machine or checkout keeps its identity; any other file by its path."""
    path = Path(path)
    folder = path.resolve().parent
    if folder == PACKAGED_DIR.resolve():
        where = f"centroidkv/data/{path.name}"
    elif folder == user_head_dir().resolve():
        where = f"<cache>/outlier_heads/{path.name}"
    else:
        where = str(path)
    if not is_file(path):
        return f"{where} {NOT_CALIBRATED}"
    return f"{where} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_head_file(path: str | Path) -> dict:
    """The parsed head file; a missing, unreadable or malformed one (a field missing or of the wrong
    type, errors not an n_layers x n_kv_heads matrix of finite numbers) raises one ValueError line."""
    path = Path(path)
    if os.path.isdir(path):
        raise ValueError(
            f"heads_file {str(path)!r} is a folder, not a file ({' or '.join(HEAD_SCORES)} or a path)"
        )
    if not is_file(path):
        raise ValueError(f"heads_file {str(path)!r} does not exist ({' or '.join(HEAD_SCORES)} or a path)")
    text = read_file_text(path, "heads_file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"heads_file {path} is not valid JSON: {error}") from None
    except RecursionError:  # a document nested deeper than the parser's stack
        raise ValueError(f"heads_file {path} is not a head file: JSON nested too deeply") from None
    missing = [key for key in FIELDS if not isinstance(data, dict) or key not in data]
    if missing:
        raise ValueError(f"heads_file {path} lacks {', '.join(missing)}")
    wrong = [key for key in ("n_layers", "n_kv_heads") if not _is_count(data[key])]
    wrong += [key for key in ("budget", "fraction") if not is_number(data[key], finite=True)]
    wrong += [key for key in ("model",) if not isinstance(data[key], str)]
    wrong += [key for key in ("outliers",) if not isinstance(data[key], list)]
    if wrong:
        raise ValueError(
            f"heads_file {path}: wrong type of {', '.join(wrong)} (n_layers and "
            "n_kv_heads are positive integers, budget and fraction numbers, model a name, outliers a list)"
        )
    if not 0 < data["budget"] <= 1 or not 0 <= data["fraction"] <= 1:
        raise ValueError(
            f"heads_file {path}: budget {data['budget']!r} (the R its errors were measured at) must be in "
            f"(0, 1] and fraction {data['fraction']!r} in [0, 1]"
        )
    errors = data["errors"]
    if (
        not isinstance(errors, list)
        or len(errors) != data["n_layers"]
        or any(not isinstance(row, list) or len(row) != data["n_kv_heads"] for row in errors)
        or not all(is_number(error, finite=True) for row in errors for error in row)
    ):
        raise ValueError(
            f"heads_file {path}: errors must be an n_layers x n_kv_heads "
            f"({data['n_layers']} x {data['n_kv_heads']}) matrix of finite numbers"
        )
    check_outliers(path, data)
    return data


def check_outliers(path: Path, data: dict) -> None:
    """One warning line (once per file) when the file's `outliers` are not the worst `fraction` of its
    `errors`: a run lists heads from `errors` at its own heads_fraction, so an `outliers` edited by
    hand does nothing, and saying so beats ignoring it silently."""
    listed = worst_heads(data["errors"], data["fraction"])
    expected = sorted([layer, head] for layer, heads in listed.items() for head in heads)
    given = data["outliers"]
    if all(isinstance(pair, list) and all(isinstance(i, int) for i in pair) for pair in given):
        if sorted(given) == expected:
            return
    text = f"outliers {given} != {expected}"
    if (str(path), text) not in _warned:
        _warned.add((str(path), text))
        print(
            f"centroidkv: warning: heads_file {path}: outliers {given} are not the worst fraction "
            f"{data['fraction']:g} of its errors ({expected}); runs list heads from errors and "
            "heads_fraction only, so edit errors, not outliers",
            file=sys.stderr,
        )


def same_model(a: str, b: str) -> bool:
    """Whether two names denote one model (`random-llama3.1-8b` and `random-llama3.1-8b:32` do, and so
    do a folder's relative and absolute paths)."""
    return a == b or head_file_key(a) == head_file_key(b)


def check_head_file(path: Path, data: dict, model_name: str, shape: tuple[int, int] | None) -> None:
    """Raise one ValueError line when the head file `data` (read from `path`) was calibrated on another
    model than `model_name`, or for another shape (layers, KV heads; None: unknown, not checked)."""
    found = (data["n_layers"], data["n_kv_heads"])
    if not same_model(data["model"], model_name) or (shape is not None and found != tuple(shape)):
        wanted = f" ({shape[0]} x {shape[1]})" if shape is not None else ""
        raise ValueError(
            f"heads_file {path} was calibrated on {data['model']!r} "
            f"({found[0]} x {found[1]} layers x KV heads), not {model_name!r}{wanted}"
        )


def worst_heads(errors: list[list[float]], fraction: float) -> dict[int, list[int]]:
    """The round(fraction * n) (layer, head) pairs with the largest error, as {layer: [heads]}."""
    import torch

    flat = torch.tensor(errors, dtype=torch.float64).flatten()
    n_heads = len(errors[0])
    count = min(flat.numel(), round(fraction * flat.numel()))
    chosen: dict[int, list[int]] = {}
    for index in flat.topk(count).indices.tolist() if count else []:
        chosen.setdefault(index // n_heads, []).append(index % n_heads)
    return {layer: sorted(heads) for layer, heads in sorted(chosen.items())}


class CalibrationMissing(ValueError):
    """`heads_file=<score>` on a model with no head file: one line naming the command that writes it.
    `model_name`, `path` (the file the score would read) and `score` let a caller calibrate and ask again."""

    def __init__(self, model_name: str, path: Path, score: str = "clustering"):
        super().__init__(
            f"no {score} head calibration for {model_name!r} ({path}); run "
            f"`python -m eval.calibrate --model {shlex.quote(model_name)} --score {score}` first (it runs "
            "the model on a few dev prompts: minutes, depending on the machine), or use heads=none"
        )
        self.model_name, self.path, self.score = model_name, path, score


_warned: set[tuple[str, str]] = set()  # (head file, differing settings) already warned about


def warn_if_settings_differ(path: Path, data: dict, settings: dict | None) -> None:
    """One warning line (once per file and difference) when a method runs with settings other than
    those the head file was calibrated with (CentroidKV on a clustering score: its heads were chosen
    for another clustering)."""
    calibrated = data.get("method")
    if not settings or not isinstance(calibrated, dict):
        return
    differing = sorted(k for k in calibrated if k in settings and settings[k] != calibrated[k])
    if not differing:
        return
    text = ", ".join(f"{k}={settings[k]!r} (calibrated with {calibrated[k]!r})" for k in differing)
    if (str(path), text) not in _warned:
        _warned.add((str(path), text))
        print(
            f"centroidkv: warning: the heads of {path.name} were calibrated with other settings "
            f"(at R = {data['budget']:g}): {text}",
            file=sys.stderr,
        )


def listed_heads_for(
    model, source: str | Path, fraction: float, settings: dict | None = None
) -> dict[int, list[int]]:
    """The heads of `model` a policy lists, from `source` (a score of `HEAD_SCORES` or a path): the
    worst `fraction` by error. `settings`: the method's parameters, compared with those the file was
    calibrated with (one warning line). Reads a file only: a score on a model without its file raises
    `CalibrationMissing` (one line)."""
    if model is None:
        raise ValueError("a head policy needs the model (a cache on a model prepared by centroidkv)")
    name = getattr(model, "centroidkv_name", "")
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    path = needed_head_file(name, shape, source, fraction)
    if path is None:  # no head to list: nothing to read or calibrate
        return {}
    data = read_head_file(path)
    check_head_file(path, data, name, shape)
    warn_if_settings_differ(path, data, settings)
    return worst_heads(data["errors"], fraction)


def needed_head_file(
    model_name: str, shape: tuple[int, int], source: str | Path, fraction: float
) -> Path | None:
    """The head file a policy listing `fraction` of the heads of a model of `shape` (layers, KV heads)
    reads from `source` (a score or a path); None when that fraction lists no head. A score without its
    file raises `CalibrationMissing` (one line)."""
    if round(fraction * shape[0] * shape[1]) == 0:
        return None
    if str(source) not in HEAD_SCORES:
        return Path(source)
    path = head_file_for(model_name, str(source))
    if path is None:
        raise CalibrationMissing(model_name, user_head_file(model_name, str(source)), str(source))
    return path


def write_head_file(data: dict, path: Path) -> Path:
    """Write the head file atomically (`centroidkv.files.write_atomic`): readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1) + "\n")
    return path
