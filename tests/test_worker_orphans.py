"""A job's worker processes (`workers=N`) end when the job's process is killed, even with SIGKILL: no one
would keep their records, and each would hold a model's memory and a core for the rest of its share
(seen: two orphaned workers of a killed `make heads` kept running beside its rerun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A stand-in for the job's process: starts one worker the way eval.workers does, says its pid, waits.
PARENT = """
import multiprocessing, sys, time
from tests.test_worker_orphans import worker
child = multiprocessing.get_context("spawn").Process(target=worker, args=(sys.argv[1] == "watch",), daemon=True)
child.start()
print(child.pid, flush=True)
child.join(600)  # ends early if the worker does
"""


def worker(watch: bool) -> None:
    """A worker's start (`eval.workers._work`), then a share that would take minutes."""
    if watch:
        from eval.workers import exit_with_parent

        exit_with_parent()
    print("ready", flush=True)
    time.sleep(600)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited child that no one reaped yet is a zombie: not live)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def child_after_parent_killed(watch: bool, wait_s: float) -> bool:
    """Kill the stand-in parent with SIGKILL once its worker has started; whether the worker still runs
    `wait_s` later."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "watch" if watch else "no"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline() == "ready\n"  # the worker is past its start
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + wait_s
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        return running(child)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads process states from /proc")
def test_a_worker_ends_when_its_parent_is_killed():
    assert not child_after_parent_killed(watch=True, wait_s=10)
    assert child_after_parent_killed(watch=False, wait_s=1)  # without the watcher it runs on
