"""Baseline compression methods, one file each; importing this package registers them all."""

from baselines import full  # noqa: F401
