"""`python -m centroidkv_vllm serve`: vLLM's OpenAI-compatible server with the plugin, started on a
loopback port, answers the README's client request (its curl line, run as written but for the port)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from test_engine import ENV, needs_model

from centroidkv_vllm.__main__ import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def readme_curl(port: int) -> str:
    """The README's curl request, at `port` instead of 8000."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("curl -s"))
    return line.replace("localhost:8000", f"127.0.0.1:{port}")


def wait_until_ready(server: subprocess.Popen, port: int, log: Path, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"no server after {seconds} s: " + log.read_text()[-3000:])


@needs_model
def test_the_server_with_the_plugin_answers_the_readmes_request(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    command = [sys.executable, "-m", "centroidkv_vllm", "serve", str(DEFAULT_MODEL), "--budget", "0.25"]
    with log.open("w") as sink:
        server = subprocess.Popen(
            [*command, "--dtype", "float32", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
    try:
        wait_until_ready(server, port, log)
        answer = subprocess.run(
            ["bash", "-c", readme_curl(port)], capture_output=True, text=True, timeout=300
        )
        completion = json.loads(answer.stdout)
        text = completion["choices"][0]["text"]
        assert completion["model"] == DEFAULT_MODEL.name and re.search(r"[A-Za-z]{3,}", text), completion
        assert "centroidkv: plugin on" in log.read_text(), log.read_text()[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
