"""The evaluation side of the CentroidKV harness: benchmarks, the runner, records and results.

- `eval.benchmarks`: one home per benchmark (`ruler/`, `longbench/`, `niah.py`, `toy.py`), each with
  its generator or loader, constants, scorer and how it is reported; found by discovery.
- `eval.text`: the shared text (the Paul Graham essay haystack, the noise filler).
"""
