"""The README's import path of prefill and decoding: `centroidkv.plan.decoding` is the module."""

from centroidkv.plan.decoding import generate_from, needs_of, prefill

__all__ = ["generate_from", "needs_of", "prefill"]
