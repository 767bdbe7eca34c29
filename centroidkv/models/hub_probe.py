"""Fail fast without the Hugging Face Hub: probe it once, and go offline when it cannot be reached.

Without `HF_HUB_OFFLINE`, huggingface_hub retries every request to an unreachable Hub with backoff
(about 75 s for one model) before the loader's clear error. One short connection attempt tells the
same thing: when it fails, the process switches to offline mode, so cached files still load and
anything else fails at once with the loader's one-line message.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
_unreachable: list[str] = []  # what this process's probe found unreachable, and went offline for


def hub_endpoint() -> tuple[str, int]:
    """The Hub's host and port (HF_ENDPOINT, default huggingface.co:443)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub endpoint (`hub_endpoint`) opens within `timeout` seconds,
    name resolution included."""
    host, port = hub_endpoint()
    result = {"ok": False}

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result["ok"] = True
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)  # getaddrinfo ignores socket timeouts
    probe.start()
    probe.join(timeout)
    return result["ok"]


def offline_unless_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Switch huggingface_hub and datasets to offline mode unless the Hub answers; True when offline."""
    import huggingface_hub.constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE:
        return True
    if hub_reachable(timeout):
        return False
    host, port = hub_endpoint()
    _unreachable.append(f"unreachable (no connection to {host}:{port} within {timeout:g} s)")
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"  # for child processes
    hub_constants.HF_HUB_OFFLINE = True  # read at each request by huggingface_hub and transformers
    if "datasets" in sys.modules:  # datasets copies the flag at import
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    return True


def hub_state() -> str:
    """How the Hub stands for this process, in words for an error line: unreachable (as the probe
    found it), offline (HF_HUB_OFFLINE set by the user), or unreachable."""
    if _unreachable:
        return _unreachable[-1]
    return "offline (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else "unreachable"
