"""Native prefills kept on disk, so that a prompt's prefill is paid once per model.

The native methods of a job fork one prefill per prompt (`centroidkv.plan.plan`); at 16k tokens on one CPU
core that forward takes minutes. With a store (`PrefillStore`: the run config's `prefill_store`),
the first job that prefills a prompt writes the prefill to a file (its cache's keys, values and
recorded needs per layer, the first token and the prefill's seconds), and a later job on the same
model and prompt reads it back instead of running the forward. Read back, every tensor equals the
computed one bit for bit, its layout and storage too, so a run forked from it keeps and predicts what
it would from a fresh prefill; its record says `prefill_stored: true`, and its `prefill_s` (so its
`ttft`) is the stored prefill's seconds: the original forward, not the reading.

What keys a file (`StoreKey`): the model (its name, its configuration and a hash of every parameter
and buffer), its dtype, the device kind (and a GPU's name), the prompt's token ids, whether a recorded
need changes the attention's arithmetic (`Recorder.uses_received`: the attention each entry receives
is computed by another kernel, named by `centroidkv.attention.RECEIVED_KERNEL`), the torch and
transformers versions and FORMAT_VERSION. The other needs are in the file's name: a file that records
more (another entry record, a longer query window) serves a prompt that asks for less, what was not
asked for dropped on reading, as a prefill that never recorded it would hold it. `max_new_tokens`
changes no tensor of a prefill: the cache read back takes the caller's.

Files are written atomically (`centroidkv.files.replaced_atomically`), so a killed job leaves none
half written; a file that cannot be read or does not match its key is computed again after a one-line
warning. Above `max_bytes` the least recently used files go. Taps (methods compressing inside the
prefill forward, `centroidkv.plan.decoding.PrefillTap`) are never stored: when the natives' prefill is
read back, the taps get a forward of their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import weakref
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from tqdm import tqdm

from centroidkv.attention import RECEIVED_KERNEL, bind_model
from centroidkv.cache.cache import CompressedCache, CompressedLayer
from centroidkv.errors import first_line
from centroidkv.files import replaced_atomically
from centroidkv.models.model_names import cache_dir, config_digest
from centroidkv.needs import RECORDERS, Need, gather_needs
from centroidkv.plan.decoding import Prefill, PrefillTap, prefill

FORMAT_VERSION = 1
SUFFIX = ".pt"
STALE_TEMPORARY_S = 3600  # a temporary file this old is a killed job's (a write takes seconds)
GB = 10**9
LABEL_PART = re.compile(r"([a-z_]+)(\d*)")


def in_units(n_bytes: int) -> str:
    """`805.3 MB`, `3.21 GB` (decimal units, as `max_gb`)."""
    return f"{n_bytes / GB:.2f} GB" if n_bytes >= GB else f"{n_bytes / 1e6:.1f} MB"


def default_folder() -> Path:
    """`<cache dir>/prefills` (`$CENTROIDKV_CACHE`, else ~/.cache/centroidkv)."""
    return cache_dir() / "prefills"


def open_store(max_gb: float, folder: str | os.PathLike | None = None) -> PrefillStore | None:
    """A store of at most `max_gb` gigabytes in `folder` (None: `default_folder()`); None for 0 GB."""
    if not max_gb:
        return None
    return PrefillStore(Path(folder).expanduser() if folder else default_folder(), int(max_gb * GB))


@dataclass(frozen=True)
class StoreKey:
    """A prefill's file: `digest` of everything but the needs (module docstring), the needs recorded
    (name -> window, 0 for entry records) and the prompt's length."""

    digest: str
    needs: tuple[tuple[str, int], ...]
    n_tokens: int

    @property
    def file_name(self) -> str:
        return f"{self.digest}.{needs_label(self.needs)}{SUFFIX}"

    def as_dict(self) -> dict[str, Any]:
        """What the file holds of its key, compared on reading."""
        return {
            "digest": self.digest,
            "needs": [list(need) for need in self.needs],
            "n_tokens": self.n_tokens,
        }


def needs_label(needs: Iterable[tuple[str, int]]) -> str:
    """`attention_sum+queries32`: each need's name and window (none for entry records); `none`."""
    return "+".join(f"{name}{window or ''}" for name, window in needs) or "none"


def parse_label(label: str) -> dict[str, int] | None:
    """The needs of a `needs_label`, None for a label that is not one."""
    if label == "none":
        return {}
    parts = [LABEL_PART.fullmatch(part) for part in label.split("+")]
    if not all(parts) or any(part[1] not in RECORDERS for part in parts):
        return None
    return {part[1]: int(part[2] or 0) for part in parts}


def covers(recorded: Mapping[str, int], asked: Mapping[str, int]) -> bool:
    """Whether a prefill that recorded `recorded` holds everything `asked` (windows at least as long)."""
    return all(name in recorded and recorded[name] >= window for name, window in asked.items())


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer of `model`: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return digest.hexdigest()


def _device_kind(device: torch.device) -> str:
    """`cpu`, or `cuda:<the GPU's name>` (kernels, and so the tensors' last bits, differ by GPU)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


class PrefillStore:
    """The prefills of `folder`, at most `max_bytes` of them (module docstring). `hits`, `misses` and
    `written_bytes` count this process's reads, computed prefills and writes."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = Path(folder), int(max_bytes)
        self.hits = self.misses = self.written_bytes = 0
        self._models: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._remove_stale_temporaries()

    def model_digest(self, model: nn.Module) -> str:
        """A hash of what decides a model's numbers (module docstring), computed once per model."""
        if model not in self._models:
            parameter = next(model.parameters())
            facts = {
                "name": getattr(model, "centroidkv_name", type(model).__name__),
                "config": config_digest(model.config.to_dict()),
                "weights": weights_digest(model),
                "dtype": str(parameter.dtype),
                "device": _device_kind(parameter.device),
                "versions": [torch.__version__, transformers.__version__, FORMAT_VERSION],
            }
            self._models[model] = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
        return self._models[model]

    def key(self, model: nn.Module, input_ids: Tensor, needs: Iterable[Need]) -> StoreKey:
        """The key of the prefill of `input_ids` ([1, n]) recording `needs` on `model`."""
        recorded = gather_needs(needs)
        received = RECEIVED_KERNEL if any(RECORDERS[name].uses_received for name in recorded) else None
        tokens = hashlib.sha256(input_ids.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()
        shape = list(input_ids.shape)
        digest = hashlib.sha256(f"{self.model_digest(model)}|{tokens}|{shape}|{received}".encode())
        return StoreKey(digest.hexdigest()[:40], tuple(sorted(recorded.items())), input_ids.shape[-1])

    def files(self) -> list[Path]:
        """The stored prefills, oldest use first."""
        return [path for _, path in sorted((status.st_mtime_ns, path) for path, status in self._stats())]

    def stored_bytes(self) -> int:
        return sum(status.st_size for _, status in self._stats())

    def _stats(self, pattern: str = f"*{SUFFIX}") -> list[tuple[Path, os.stat_result]]:
        """The files of the folder matching `pattern` and their status; one that another job (a worker)
        removes meanwhile is left out."""
        found = []
        for path in self.folder.glob(pattern) if self.folder.is_dir() else []:
            try:
                found.append((path, path.stat()))
            except FileNotFoundError:
                continue
        return found

    def read(self, model: nn.Module, key: StoreKey, max_new_tokens: int) -> Prefill | None:
        """The stored prefill of `key` (a file recording the same or more needs), None when there is
        none; a file that cannot be read or does not match is reported in one line and left to be
        written again."""
        for path, recorded in self._candidates(key):
            try:
                payload = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
                file_key = replace(key, needs=tuple(sorted(recorded.items())))
                loaded = _prefill_of(model, payload, file_key, dict(key.needs), max_new_tokens)
            except (MemoryError, torch.cuda.OutOfMemoryError):
                raise  # the file may be sound: a prefill would not fit either
            except Exception as error:  # a torn, corrupt or foreign file: computed again
                print(
                    f"[prefill store] warning: {path}: {first_line(error)}; computing it again",
                    file=sys.stderr,
                )
                path.unlink(missing_ok=True)
                continue
            try:
                os.utime(path)  # used now: the last to go
            except FileNotFoundError:  # removed by another job's eviction meanwhile: read all the same
                pass
            return loaded
        return None

    def _candidates(self, key: StoreKey) -> list[tuple[Path, dict[str, int]]]:
        """Files of `key`'s digest whose needs cover `key`'s, the smallest first."""
        found = []
        for path, status in self._stats(f"{key.digest}.*{SUFFIX}"):
            recorded = parse_label(path.name[len(key.digest) + 1 : -len(SUFFIX)])
            if recorded is not None and covers(recorded, dict(key.needs)):
                found.append((status.st_size, path.name, path, recorded))
        return [(path, recorded) for _, _, path, recorded in sorted(found)]

    def write(self, key: StoreKey, prefilled: Prefill) -> None:
        """Keep `prefilled` under `key` (atomically), then drop the least recently used files above
        the limit; one line says its size. A failing write is one warning line: the job goes on."""
        path = self.folder / key.file_name
        try:
            payload = _payload(prefilled, key)
            self.folder.mkdir(parents=True, exist_ok=True)
            with replaced_atomically(path) as temporary, open(temporary, "wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            size = path.stat().st_size
        except (OSError, RuntimeError, ValueError) as error:
            print(f"[prefill store] warning: not written ({first_line(error)})", file=sys.stderr)
            return
        self.written_bytes += size
        self._evict()
        kept = "" if path.exists() else ", more than the limit: not kept"
        tqdm.write(  # above the job's progress bar, not on its line
            f"[prefill store] wrote {in_units(size)} for a {key.n_tokens}-token prompt{kept} "
            f"(store: {in_units(self.stored_bytes())} of {in_units(self.max_bytes)})"
        )

    def _evict(self) -> None:
        """Remove the least recently used files until the store holds at most `max_bytes`."""
        by_use = sorted(self._stats(), key=lambda found: found[1].st_mtime_ns)
        total = sum(status.st_size for _, status in by_use)
        for path, status in by_use:
            if total <= self.max_bytes:
                break
            total -= status.st_size
            path.unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        """A killed job's temporary file (never renamed into place) goes once it is old."""
        for path, status in self._stats(f".*{SUFFIX}.tmp"):
            if time.time() - status.st_mtime > STALE_TEMPORARY_S:
                path.unlink(missing_ok=True)

    def summary(self) -> str:
        """One line: this process's hits and misses, and what the store holds."""
        return (
            f"[prefill store] {self.hits} read, {self.misses} computed ({in_units(self.written_bytes)} "
            f"written); {self.folder}: {in_units(self.stored_bytes())} of {in_units(self.max_bytes)}"
        )


def stored_prefill(
    store: PrefillStore | None,
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    needs: Iterable[Need] = (),
    taps: Mapping[Hashable, PrefillTap] | None = None,
) -> Prefill:
    """`centroidkv.plan.decoding.prefill` through `store`: read back when stored (then without the taps,
    `Prefill.stored`), else computed and written (the natives' part of a forward with taps)."""
    needs = list(needs)
    if store is None:
        return prefill(model, input_ids, max_new_tokens, needs=needs, taps=taps)
    key = store.key(model, input_ids, needs)
    stored = store.read(model, key, max_new_tokens)
    if stored is not None:
        store.hits += 1
        return stored
    store.misses += 1
    computed = prefill(model, input_ids, max_new_tokens, needs=needs, taps=taps)
    store.write(key, computed)
    return computed


def _payload(prefilled: Prefill, key: StoreKey) -> dict[str, Any]:
    """What a file holds: its key, the prefill's seconds and first token, and each layer's state."""
    layers = []
    for layer in prefilled.cache.layers:
        group = layer.main
        if len(layer.groups) != 1 or group.packed or group.heads is not None:
            raise ValueError(f"layer {layer.layer_idx} is not a full prefill's (split or packed)")
        layers.append(
            {
                "window": layer.window,
                "scaling": float(layer.scaling),
                "query_group": layer.query_group,
                "n_seen": layer.n_seen,
                "prompt_len": layer.prompt_len,
                "keys": group.keys,
                "values": group.values,
                "log_degree": group.log_degree,
                "extras": dict(group.extras),
                "windows": dict(group.windows),
            }
        )
    return {
        "version": FORMAT_VERSION,
        "key": key.as_dict(),
        "seconds": float(prefilled.seconds),
        "first_token": prefilled.first_token,
        "layers": layers,
    }


def _prefill_of(
    model: nn.Module, payload: dict[str, Any], key: StoreKey, asked: Mapping[str, int], max_new_tokens: int
) -> Prefill:
    """The prefill a file's `payload` holds (recording `key.needs`) as a prefill of `model` recording
    only the needs `asked` would be: the same entries, the records asked for, each query window cut to
    the rows asked for. ValueError when the file is not the prefill of `key`."""
    if payload.get("version") != FORMAT_VERSION or payload.get("key") != key.as_dict():
        raise ValueError("another prefill's file (its key differs)")
    cache = CompressedCache("full", 1.0, max_new_tokens, needs=[Need(n, w) for n, w in asked.items()])
    bind_model(cache, model)
    states = payload["layers"]
    if len(states) != cache.n_layers:
        raise ValueError(f"{len(states)} layers, the model has {cache.n_layers}")
    for index, state in enumerate(states):
        cache.layers.append(_layer_of(cache, index, state, key))
    first_token = payload["first_token"]
    if tuple(first_token.shape) != (states[0]["keys"].shape[0], 1):
        raise ValueError(f"a first token of shape {tuple(first_token.shape)}")
    return Prefill(cache, first_token, float(payload["seconds"]), stored=True)


def _layer_of(cache: CompressedCache, index: int, state: dict[str, Any], key: StoreKey) -> CompressedLayer:
    """Layer `index` of `cache` from a file's `state` (of `key`), its shapes and records checked."""
    layer, n_tokens = cache.new_layer(index), key.n_tokens
    keys, values = state["keys"], state["values"]
    entries = cache.layer_entries(index, n_tokens)
    if state["window"] != layer.window or state["n_seen"] != n_tokens or state["prompt_len"] != n_tokens:
        raise ValueError(f"layer {index} is not a {n_tokens}-token prefill of this model")
    if keys.dim() != 4 or keys.shape[2] != entries or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"layer {index}: keys of shape {tuple(keys.shape)}, {entries} entries expected")
    recorded = dict(key.needs) if layer.compresses else {}  # a window layer records nothing
    extras, windows = state["extras"], state["windows"]
    if set(extras) | set(windows) != set(recorded) or any(e.shape != keys.shape[:3] for e in extras.values()):
        raise ValueError(
            f"layer {index}: records {sorted(extras)} {sorted(windows)}, {sorted(recorded)} expected"
        )
    layer.scaling, layer.query_group = state["scaling"], state["query_group"]
    layer.n_seen, layer.prompt_len = n_tokens, n_tokens
    layer.is_initialized, layer.dtype, layer.device = True, keys.dtype, keys.device
    group = layer.main
    group.dtype, group.keys, group.values, group.log_degree = keys.dtype, keys, values, state["log_degree"]
    if layer.compresses:
        group.extras = {name: extras[name] for name in cache.entry_needs}
        group.windows = {name: _last_rows(windows[name], rows) for name, rows in cache.window_needs.items()}
    return layer


def _last_rows(window: Tensor, rows: int) -> Tensor:
    """A window record's last `rows` rows, as a prefill recording `rows` keeps them (its own copy)."""
    return window if window.shape[2] <= rows else window[:, :, -rows:].clone()
