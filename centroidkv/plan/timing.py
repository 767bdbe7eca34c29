"""Time and memory of a run: `Timer` (CUDA events on a GPU, `perf_counter` on a CPU) and the peak
memory per device."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Span:
    seconds: float = 0.0


class Timer:
    """`with Timer(device).span() as span: ...` -> span.seconds. On CUDA the block is bracketed by
    events and the end event is synchronised, so asynchronous kernels are counted."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    @contextmanager
    def span(self) -> Iterator[Span]:
        result = Span()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield result
            end.record()
            end.synchronize()
            result.seconds = start.elapsed_time(end) / 1000.0
        else:
            start_time = time.perf_counter()
            yield result
            result.seconds = time.perf_counter() - start_time


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window (CUDA only; CPU peak RSS is process-wide and cannot be reset)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str) -> tuple[int, str]:
    """(bytes, kind): CUDA max allocated since the last reset, or the process's peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "cpu_peak_rss"
