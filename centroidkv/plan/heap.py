"""A process that keeps the memory it frees: a long prompt's temporaries are reused, not faulted in again.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap`
and unmaps it when it is freed. A long prompt's forward allocates and frees such blocks in every
layer (one MLP activation of a 16k-token prompt on Qwen2.5-0.5B: 16384 x 4864 floats, 319 MB), so
the kernel maps and zeroes every page again at its first touch: system time that was 9 % of an 8k
prefill's CPU time on one core and 11-15 % at 4k (docs/speed.md). With mmap off (`M_MMAP_MAX` 0)
and the heap's trim threshold raised (`M_TRIM_THRESHOLD`: it is given back only when 2 GB lie free
at its top), a freed block stays in the heap for the next allocation. Nothing computed changes: the
same kernels run on buffers with the same 64-byte alignment (torch's), and a prefill's keys,
values, records and first token are bit-identical either way (docs/speed.md). The price is that the
process holds its peak heap until it exits, which a job's process reaches on its first long sample
anyway.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_ABOVE = 2**31 - 1  # bytes free at the heap's top before it is given back (mallopt takes an int)


def keep_freed_memory() -> bool:
    """Make this process's malloc keep what it frees (module docstring); False where the C library
    is not glibc (macOS, musl): nothing changes there."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library has other mallopt parameters
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))
