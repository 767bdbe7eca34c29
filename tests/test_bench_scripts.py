"""The throughput benchmark and the GPU check script, at tiny sizes on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_throughput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_throughput_batches_fit_the_cap(capsys):
    args = bench_throughput.parse_args(
        ["--model", "tiny-llama", "--length", "1024", "--new-tokens", "4", "--full-batch", "2",
         "--runs", "full:1", "centroidkv:0.25", "streaming_llm:0.5"]
    )  # fmt: skip
    runs = bench_throughput.throughput_table(args)
    full, merged, evicted = runs
    cap = 2 * full.peak_bytes_per_seq
    assert full.batch == 2 and full.peak_bytes == cap
    # 2 layers: the prefill transient (layer 0 compressed into its B + g buffer, layer 1 whole)
    # dominates the peak: about (0.25 + 0.06 + 1) / 2 of the full cache -> 3 sequences;
    # (0.5 + 0.06 + 1) / 2 -> 2 sequences
    assert merged.batch == cap // merged.peak_bytes_per_seq == 3
    assert evicted.batch == cap // evicted.peak_bytes_per_seq == 2
    assert all(run.peak_bytes <= cap and run.tokens_per_s > 0 for run in runs)
    assert "| centroidkv | 0.25 |" in capsys.readouterr().out


def test_throughput_bad_input_exits_2():
    for argv in (["--runs", "centroidkv:0.25"], ["--runs", "full:1", "nope:0.5"], ["--model", "gpt-9"]):
        with pytest.raises(SystemExit) as exit_info:
            bench_throughput.parse_args(argv)
        assert exit_info.value.code == 2


def test_gpu_check_dry_run(tmp_path):
    """scripts/gpu_check.sh --dry-run: every section of the GPU check at tiny sizes on the CPU."""
    completed = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for heading in (
        "## TPOT and peak memory",
        "## Compression time per call",
        "## Fused attention",
        "## Throughput",
    ):
        assert heading in summary
    assert "sections failed: none" in summary
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(error < 1e-4 for error in (k["error"] for k in results["fused_attention"]["kernels"]))
    rows = results["tpot_memory"]["rows"]
    assert [r["method"] for r in rows[:3]] == ["full", "centroidkv", "transformers"]  # per length
    assert (tmp_path / "log.txt").exists()


def test_gpu_check_reference_decode_gives_the_model_back_its_own_attention():
    """The transformers reference row switches the model to stock SDPA for its decode and back: the
    rows after it must run with the degree-aware attention again."""
    import gpu_check

    from centroidkv import load_model
    from centroidkv.attention import ATTN_IMPLEMENTATION

    model = load_model("tiny-llama")[0]
    decoded = gpu_check.transformers_decode(model, torch.randint(3, 100, (1, 64)), 4)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert decoded.peak_bytes > 0 and decoded.tpot_s > 0


def test_kmeans_error_table_runs_on_the_embedded_model():
    """Before: `make bench-kmeans` stopped in its error table (AttributeError: 'list' object has no
    attribute 'inv_freq'): it gave the cache's per-layer list of rotary tables as one layer's."""
    import bench_kmeans

    args = bench_kmeans.parse_args(["--prompt-tokens", "400", "--queries", "8", "--iterations", "2"])
    result = bench_kmeans.error_table(args)
    assert 0 < result["centroidkv"] <= result["centroidkv_max"] < 1
    assert 0 < result["kmeans"] <= result["kmeans_max"]
