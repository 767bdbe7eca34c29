"""The plugin's tests (`make serve-test`; `make test` runs them without those marked slow)."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "slow: minutes of vLLM engine time; `make serve-test` runs it, `make test` leaves it out"
    )
