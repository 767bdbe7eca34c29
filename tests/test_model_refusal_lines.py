"""Refusals about a model say what is wrong and come fast: a byte budget a hybrid model's window layers
alone exceed names those layers; an over-long Hub id and a calibration window beyond the model's
positions are one line before torch is imported; `load_model` takes a path object."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hybrid_attention import built, tiny_qwen2
from test_model_folder_safety import ROOT, cache_with_schema
from transformers import LlamaConfig, LlamaForCausalLM

from centroidkv import CompressedCache, prepare_model
from centroidkv.models.loading import load_model


def test_a_budget_below_the_window_layers_bytes_names_them():
    """Before: "(fixed buffers) ... raise the budget, keep fewer heads whole", though no head is kept
    whole and what takes the bytes are the window layers."""
    model = prepare_model(built(tiny_qwen2, "eager"))  # layers 2 and 3 attend over a window of 8
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError) as error, torch.no_grad():
        model(ids, past_key_values=CompressedCache("streaming_llm", 0.1, 4, budget_unit="bytes"))
    assert "(the 2 sliding-window layers (layers 2, 3)) already takes" in str(error.value)
    assert str(error.value).endswith("; raise the budget, or use budget_unit=entries")


def run_without_torch(cache: Path, *argv: str) -> tuple[int, str, bool]:
    """A command line (a script's path or `-m module`) run in a fresh interpreter on a new cache
    (`cache_with_schema`): its exit code, its standard error, and whether torch was imported by the
    time it returned."""
    cache_with_schema(cache)
    module = argv[1] if argv[0] == "-m" else None
    script = (
        "import runpy, sys\n"
        f"sys.argv = {list(argv[1:] if module else argv)!r}\n"
        "code = 0\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True) if {module!r} "
        "else runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CENTROIDKV_CACHE": str(cache)},
    )  # fmt: skip
    code, torch_imported = result.stdout.split()[-2:]
    return int(code), result.stderr.strip(), torch_imported == "True"


def test_an_over_long_hub_id_is_one_short_line_before_torch(tmp_path):
    """Before: taken as a Hub id, torch imported (11.6 s), and the 304 characters repeated."""
    name = "org/" + "x" * 300
    code, err, torch_imported = run_without_torch(
        tmp_path, str(ROOT / "scripts" / "generate.py"), "--model", name, "--prompt", "hi"
    )
    assert code == 2 and not torch_imported
    assert len(err.splitlines()) == 1 and name not in err and len(err) < 300, err
    assert "at most 96 characters" in err


def test_calibrate_tokens_beyond_the_positions_is_refused_before_torch(tmp_path):
    """Before: refused correctly, but after importing torch and transformers (11.6 s)."""
    code, err, torch_imported = run_without_torch(tmp_path, "-m", "eval.calibrate", "--tokens", "100000")
    assert code == 2 and not torch_imported
    assert err == "calibrate: --tokens 100000 exceeds smollm2-135m's 8192 positions: give at most 8192"


def test_load_model_takes_a_path_object(tmp_path):
    """Before: "model must be a name, a folder, a .gguf file or a Hugging Face id, got PosixPath(...)"."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path, device="cpu")
    assert model.centroidkv_name == str(tmp_path.resolve())
