"""Benchmarks for the CentroidKV harness.

- `eval.ruler`: the 13 RULER tasks generated locally at any length (NVIDIA/RULER).
- `eval.longbench`: LongBench v1 and LongBench-E samples with the reference prompts (THUDM/LongBench).
- `eval.metrics`: the reference scorers of both benchmarks.
- `eval.niah`: a needle-in-a-haystack grid (depth x length) for the classic heatmap.
"""
