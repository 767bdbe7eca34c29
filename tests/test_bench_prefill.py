"""scripts/bench_prefill.py: the FLOPs it divides by, its one-line refusals, and a tiny run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_flops_are_the_linear_layers_per_token_and_the_causal_triangle():
    from centroidkv import load_model

    model = load_model("tiny-llama")[0]
    config = model.config
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_token = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner)  # q o, k v, mlp
    flops = bench_prefill.prefill_flops(model, 100)
    assert flops["linear"] == 2 * per_token * 100 + 2 * hidden * config.vocab_size  # one logit row
    assert flops["attention"] == layers * 4 * config.num_attention_heads * head_dim * 100 * 101 / 2


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--model", "gpt-9"], "gpt-9"),
        (["--lengths", "1"], "--lengths must be at least 2"),
        (["--needs", "nope"], "unknown method(s) nope"),
        (["--threads", "0"], "--threads must be 1..256"),
    ],
)
def test_bad_input_is_one_line_before_a_model_loads(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_prefill.parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert fragment in error and "\n" not in error


def test_a_tiny_run_prints_a_row_per_length_and_records(capsys):
    bench_prefill.main(
        ["--model", "tiny-llama", "--lengths", "64", "128", "--needs", "h2o", "--matmul-size", "256"]
    )
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 64 ") or line.startswith("| 128 ")
    ]
    assert [row.split(" | ")[1] for row in rows] == ["none", "h2o", "none", "h2o"]
    assert all(float(row.split(" | ")[-1].rstrip(" |")) > 0 for row in rows)  # the ratio to the matmul
