"""The throughput benchmark and the GPU check script, at tiny sizes on CPU."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_throughput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_throughput_batches_fit_the_cap(capsys):
    args = bench_throughput.parse_args(
        ["--model", "tiny-llama", "--length", "512", "--new-tokens", "4", "--full-batch", "2",
         "--runs", "full:1", "centroidkv:0.25", "streaming_llm:0.5"]
    )  # fmt: skip
    runs = bench_throughput.throughput_table(args)
    full, merged, evicted = runs
    cap = 2 * full.peak_bytes_per_seq
    assert full.batch == 2 and full.peak_bytes == cap
    # 2 layers: the prefill transient (layer 0 compressed, layer 1 whole) dominates the peak:
    # about (0.25 + 1) / 2 of the full cache -> 3 sequences; (0.5 + 1) / 2 -> 2 sequences
    assert merged.batch == cap // merged.peak_bytes_per_seq == 3
    assert evicted.batch == cap // evicted.peak_bytes_per_seq == 2
    assert all(run.peak_bytes <= cap and run.tokens_per_s > 0 for run in runs)
    assert "| centroidkv | 0.25 |" in capsys.readouterr().out


def test_throughput_bad_input_exits_2():
    for argv in (["--runs", "centroidkv:0.25"], ["--runs", "full:1", "nope:0.5"], ["--model", "gpt-9"]):
        with pytest.raises(SystemExit) as exit_info:
            bench_throughput.parse_args(argv)
        assert exit_info.value.code == 2
