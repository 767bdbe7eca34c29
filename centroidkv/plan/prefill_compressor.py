"""What a method that compresses inside a prefill forward instead of forking the shared prefill (a
bridge to another library's prefill hooks, e.g. kvpress's presses) hands the per-prompt plan
(`centroidkv.plan.plan.run`): a `PrefillCompressor` gives one `PrefillRun` per run and prompt."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import nn

from centroidkv.cache.cache import CompressedCache
from centroidkv.methods import Method
from centroidkv.wrapper import innermost


class PrefillRun(Protocol):
    """One run of a `PrefillCompressor` on one prompt; it holds every piece of per-run state.

    `shares_prefill`: it compresses its fork of a shared prefill as a `PrefillTap` (`after_layer`);
    otherwise `prefill_hooks` are active during a prefill of its own, whose cache they compress.
    `decoding_hooks` are active while its question is fed and it decodes; `decodes_alone` says they
    change the model (so the run is never batched with others). `record_fields` are added to its
    record (e.g. whether it saved memory or only masked)."""

    shares_prefill: bool

    def after_layer(self, module: nn.Module, kwargs: dict, output: Any, cache: CompressedCache) -> None: ...

    def prefill_hooks(self, model: nn.Module) -> AbstractContextManager: ...

    def decoding_hooks(self, model: nn.Module) -> AbstractContextManager: ...

    @property
    def decodes_alone(self) -> bool: ...

    def record_fields(self) -> dict[str, Any]: ...


@runtime_checkable
class PrefillCompressor(Protocol):
    """A method that compresses inside a prefill forward rather than forking the shared prefill.
    `budget` means what it means for every method: R * (context_len + max_new_tokens) entries."""

    def prefill_run(
        self, model: nn.Module, budget: float, context_len: int, max_new_tokens: int, share_prefill: bool
    ) -> PrefillRun: ...


def compresses_in_prefill(method: Method) -> bool:
    """Whether `method` (inside its wrappers, `centroidkv.wrapper`) is a `PrefillCompressor`."""
    return isinstance(innermost(method), PrefillCompressor)
