"""Baseline compression methods, one file each; importing this package registers them all."""

from baselines import cam, full, h2o, kmeans, pyramidkv, snapkv, streaming_llm  # noqa: F401
