"""centroidkv.plan.heap: a process that keeps its freed memory touches a block allocated where a freed
one was without page faults; without it, glibc maps a large block afresh and every page faults again."""

from __future__ import annotations

import subprocess
import sys

import pytest

ALLOCATE_TWICE = """
import resource, sys, torch
from centroidkv.plan.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
block = torch.ones(96 * 2**20 // 4)  # above glibc's largest mmap threshold (32 MiB)
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = torch.ones(64 * 2**20 // 4)  # fits where the first one was (an aligned block of the same size may not)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_second_block(mode: str) -> tuple[bool, int]:
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATE_TWICE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    kept, faults = done.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_freed_block_is_reused_without_page_faults():
    kept, faults = faults_of_second_block("keep")
    if not kept:
        pytest.skip("not glibc: keep_freed_memory changes nothing here")
    _, faults_by_default = faults_of_second_block("default")
    pages = 64 * 2**20 // 4096
    assert faults_by_default > pages // 2  # mapped afresh: every 4 KiB page faults once
    assert faults < pages // 20  # the same heap block again
