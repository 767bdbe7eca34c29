"""CentroidKV's outlier heads: the (layer, KV head) pairs that clustering hurts most, and their files.

The paper (v1) finds ~4 % of heads that clustering damages and keeps their full cache. Our measure
of the damage (`calibrate_heads`), on token windows the caller gives: prefill each window with a full
cache, compress a fork with CentroidKV (its defaults, no outlier heads) to a budget, and compare each
KV head's attention output for the last 64 queries (its query heads, the degree-aware attention,
causal) against the full cache's: relative L2 error ||o_compressed - o_full|| / ||o_full||, averaged
over the windows. The last queries are what the next tokens see, the heads' output (not their keys)
is what the model consumes, and relative error compares heads of different output scale.
The worst `fraction` of all (layer, KV head) pairs are the outlier heads.

The library holds no text: the harness's command (`python -m eval.calibrate --model NAME`) feeds it
windows of the dev essays and writes the JSON (model, budget, fraction, per-head errors, the list) to
`<cache dir>/outlier_heads/<model>.json` (`$CENTROIDKV_CACHE`, else ~/.cache/centroidkv; a cut random
model's file is `<model>-<N>layers.json`). `outlier_heads=auto` reads that file before the one shipped
in the package (`centroidkv/data/`, the embedded model's), and names the file it read, with its content
hash, in the job's identity and every record. A model without either file is refused with one line
(`CalibrationMissing`): reading the heads never loads a tokenizer or runs a prefill.
"""

from __future__ import annotations

# Light imports only: `python -m eval.calibrate --help` imports this module and must not wait for
# torch. Everything heavy (torch, tqdm, the models, the cache) is imported inside the functions that
# use it.
import hashlib
import json
import math
import os
import sys
import tempfile
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING

from centroidkv.budget import DEFAULT_BUDGET_UNIT

if TYPE_CHECKING:
    from torch import Tensor

PACKAGED_DIR = Path(__file__).parent / "data"
FIELDS = ("model", "budget", "fraction", "n_layers", "n_kv_heads", "errors", "outliers")


def head_file_key(model_name: str) -> str:
    """The file-name stem of a model's head files: its canonical name (`centroidkv.models`), a depth
    written `-<N>layers` (`random-llama3.1-8b:2` -> `random-llama3.1-8b-2layers`), so that two depths
    of one model never share a file; a path-like name of a user's own model has its `/` as `--`."""
    from centroidkv.models import canonical_model_name

    name = canonical_model_name(model_name)
    base, colon, depth = name.partition(":")
    if colon and depth.isdigit():  # a paper-shaped model cut to its first `depth` layers
        return f"{base}-{depth}layers"
    return name.replace("/", "--")


def user_head_dir() -> Path:
    """Where user calibrations live: `<cache dir>/outlier_heads` (`$CENTROIDKV_CACHE`)."""
    from centroidkv.models import cache_dir

    return cache_dir() / "outlier_heads"


def user_head_file(model_name: str) -> Path:
    """The user's calibration of `model_name`: `<cache dir>/outlier_heads/<key>.json`."""
    return user_head_dir() / f"{head_file_key(model_name)}.json"


def packaged_head_file(model_name: str) -> Path:
    """The calibration of `model_name` shipped in the package (exists for the embedded model)."""
    return PACKAGED_DIR / f"outlier_heads_{head_file_key(model_name)}.json"


def head_file_for(model_name: str) -> Path | None:
    """The head file `outlier_heads=auto` uses for `model_name`: the user's calibration, else the one
    shipped in the package, else None (not calibrated yet)."""
    return next(
        (p for p in (user_head_file(model_name), packaged_head_file(model_name)) if p.is_file()), None
    )


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
    if not path.is_file():
        return f"{where} (not calibrated yet)"
    return f"{where} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_head_file(path: str | Path) -> dict:
    """The parsed head file; a missing, unreadable or malformed one (a field missing or of the wrong
    type, errors not an n_layers x n_kv_heads matrix of finite numbers) raises one ValueError line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"centroidkv: outlier_heads file {str(path)!r} does not exist (none, auto or a path)"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"centroidkv: outlier_heads file {path} is not valid JSON: {error}") from None
    missing = [key for key in FIELDS if not isinstance(data, dict) or key not in data]
    if missing:
        raise ValueError(f"centroidkv: outlier_heads file {path} lacks {', '.join(missing)}")
    wrong = [key for key in ("n_layers", "n_kv_heads") if not _is_count(data[key])]
    wrong += [key for key in ("budget", "fraction") if not _is_number(data[key])]
    wrong += [key for key in ("model",) if not isinstance(data[key], str)]
    wrong += [key for key in ("outliers",) if not isinstance(data[key], list)]
    if wrong:
        raise ValueError(
            f"centroidkv: outlier_heads file {path}: wrong type of {', '.join(wrong)} (n_layers and "
            "n_kv_heads are positive integers, budget and fraction numbers, model a name, outliers a list)"
        )
    errors = data["errors"]
    if (
        not isinstance(errors, list)
        or len(errors) != data["n_layers"]
        or any(not isinstance(row, list) or len(row) != data["n_kv_heads"] for row in errors)
        or not all(_is_number(error) for row in errors for error in row)
    ):
        raise ValueError(
            f"centroidkv: outlier_heads file {path}: errors must be an n_layers x n_kv_heads "
            f"({data['n_layers']} x {data['n_kv_heads']}) matrix of finite numbers"
        )
    return data


def same_model(a: str, b: str) -> bool:
    """Whether two names denote one model (`random-llama3.1-8b` and `random-llama3.1-8b:32` do)."""
    from centroidkv.models import canonical_model_name

    return canonical_model_name(a) == canonical_model_name(b)


def check_head_file(path: Path, data: dict, model_name: str, shape: tuple[int, int] | None) -> None:
    """Raise one ValueError line when the head file `data` (read from `path`) was calibrated on another
    model than `model_name`, or for another shape (layers, KV heads; None: unknown, not checked)."""
    found = (data["n_layers"], data["n_kv_heads"])
    if not same_model(data["model"], model_name) or (shape is not None and found != tuple(shape)):
        wanted = f" ({shape[0]} x {shape[1]})" if shape is not None else ""
        raise ValueError(
            f"centroidkv: outlier_heads file {path} was calibrated on {data['model']!r} "
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
    """`outlier_heads=auto` on a model with no head file: one line naming the command that writes
    it. `model_name` and `path` (the file `auto` would read) let a caller calibrate and ask again."""

    def __init__(self, model_name: str, path: Path):
        super().__init__(
            f"centroidkv: no outlier-head calibration for {model_name!r} ({path}); run "
            f"`python -m eval.calibrate --model {model_name}` first, or use outlier_heads=none"
        )
        self.model_name, self.path = model_name, path


_warned: set[tuple[str, str]] = set()  # (head file, differing settings) already warned about


def warn_if_settings_differ(path: Path, data: dict, settings: dict | None) -> None:
    """One warning line (once per file and difference) when CentroidKV runs with settings other than
    those the head file was calibrated with: its outlier heads were chosen for another clustering."""
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
            f"centroidkv: warning: outlier heads of {path.name} were calibrated with other settings: {text}",
            file=sys.stderr,
        )


def outlier_heads_for(
    model, source: str | Path, fraction: float, settings: dict | None = None
) -> dict[int, list[int]]:
    """Outlier heads of `model` from `source` ("auto" or a path), the worst `fraction` by error.
    `settings`: the CentroidKV parameters of the run, compared with the file's (one warning line).
    Reads a file only: `auto` on a model without one raises `CalibrationMissing` (one line)."""
    if model is None:
        raise ValueError(
            "centroidkv: outlier heads need the model (a cache on a model prepared by centroidkv)"
        )
    name = getattr(model, "centroidkv_name", "")
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads)
    if round(fraction * shape[0] * shape[1]) == 0:  # no head to keep whole: nothing to read or calibrate
        return {}
    if str(source) == "auto":
        path = head_file_for(name)
        if path is None:
            raise CalibrationMissing(name, user_head_file(name))
    else:
        path = Path(source)
    data = read_head_file(path)
    check_head_file(path, data, name, shape)
    warn_if_settings_differ(path, data, settings)
    return worst_heads(data["errors"], fraction)


def head_attention(
    queries: Tensor, keys: Tensor, values: Tensor, log_degree: Tensor | None, scaling: float
) -> Tensor:
    """Causal degree-aware attention of the last w queries, per query head: [B, Hq, w, D] float32."""
    from centroidkv.cache import causal_allowed

    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    logits = queries.float() @ keys.transpose(-1, -2) * scaling
    if log_degree is not None:
        logits = logits + log_degree.float().repeat_interleave(group, 1).unsqueeze(2)
    allowed = causal_allowed(queries.shape[2], keys.shape[2], keys.device)
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ values


def kv_head_energy(outputs: Tensor, n_kv_heads: int) -> Tensor:
    """[Hkv]: sum of squares of [B, Hq, w, D] over the query heads of each KV head (and B, w, D)."""
    return outputs.square().unflatten(1, (n_kv_heads, -1)).sum(dim=(0, 2, 3, 4))


def head_errors(model, prompts: list[Tensor], budget: float, method=None, n_queries: int = 64) -> Tensor:
    """[n_layers, n_kv_heads] relative L2 error of each KV head's attention output (see the module)."""
    import torch

    with torch.inference_mode():
        return _head_errors(model, prompts, budget, method, n_queries)


def _head_errors(model, prompts: list[Tensor], budget: float, method, n_queries: int) -> Tensor:
    import torch
    from tqdm import tqdm

    from centroidkv import CompressedCache, get_method
    from centroidkv.needs import query_window

    method = method or get_method("centroidkv", outlier_heads="none")
    total = None
    for ids in tqdm(prompts, desc="calibrating outlier heads", unit="prompt"):
        full = CompressedCache("full", 1.0, 0, needs=[*query_window(n_queries), *method.needs()])
        model(ids, past_key_values=full, logits_to_keep=1)
        compressed = full.fork(method, budget)
        rows = []
        for reference, layer in zip(full.layers, compressed.layers, strict=True):
            queries = reference.queries
            expected = head_attention(queries, reference.keys, reference.values, None, reference.scaling)
            got = head_attention(queries, layer.keys, layer.values, layer.log_degree, reference.scaling)
            n_kv_heads = reference.keys.shape[1]
            rows.append(
                (kv_head_energy(got - expected, n_kv_heads) / kv_head_energy(expected, n_kv_heads)).sqrt()
            )
        errors = torch.stack(rows)
        total = errors if total is None else total + errors
    return total / len(prompts)


def calibrate_heads(
    model,
    name: str,
    prompts: list[Tensor],
    budget: float = 0.25,
    fraction: float = 0.04,
    text: str = "",
) -> dict:
    """Measure every head's error on the token windows `prompts` ([1, T] each, on any device) and
    return the head file's content; `text` says in words what the windows are (kept in the file)."""
    from centroidkv import get_method

    device = next(model.parameters()).device
    method = get_method("centroidkv", outlier_heads="none")  # its defaults, no outlier heads
    errors = head_errors(model, [ids.to(device) for ids in prompts], budget, method)
    data = {
        "model": name,
        "budget": budget,
        "budget_unit": DEFAULT_BUDGET_UNIT,
        "fraction": fraction,
        "n_layers": errors.shape[0],
        "n_kv_heads": errors.shape[1],
        "text": text,
        "measure": "relative L2 error of each KV head's attention output, clustered vs full cache",
        "method": {k: v for k, v in method.params().items() if not k.startswith("outlier")},
        "errors": [[round(float(e), 6) for e in row] for row in errors],
    }
    data["outliers"] = [
        [layer, head] for layer, heads in worst_heads(data["errors"], fraction).items() for head in heads
    ]
    return data


def write_head_file(data: dict, path: Path) -> Path:
    """Write the head file through a temporary file and a rename: readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
