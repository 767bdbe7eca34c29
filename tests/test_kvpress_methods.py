"""kvpress's presses as the method `kvpress`: the runner's own-prefill path, the cross-check of the
native SnapKV / StreamingLLM against kvpress's presses through the runner, masked presses, decode-time
compression, bad input, and the zoo's coverage of every press."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from centroidkv import get_method, load_model, load_tokenizer
from centroidkv.plan.decoding import prefill
from eval.benchmarks.toy import Toy
from eval.evaluate import Evaluator
from eval.run_config import MethodSpec

pytestmark = pytest.mark.usefixtures("one_thread")

kvpress = pytest.importorskip("kvpress")

from baselines.kvpress_press import ZOO_SKIPS, press_names  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 0.25
# kvpress's defaults (SnapKVPress: window 64, kernel 5; StreamingLLMPress: 4 sinks) and the native
# parameters that make the same rule (tests/test_kvpress_crosscheck.py explains each).
PAIRS = {
    "snapkv": (
        MethodSpec("snapkv", BUDGET, {"n_sink": 0, "n_recent": 64, "window_size": 64, "kernel_size": 5}),
        MethodSpec("kvpress", BUDGET, {"press": "SnapKVPress"}),
    ),
    "streaming_llm": (
        MethodSpec("streaming_llm", BUDGET, {"n_sink": 4}),
        MethodSpec("kvpress", BUDGET, {"press": "StreamingLLMPress"}),
    ),
}


def toy_sample(tokenizer, length: int) -> dict:
    return Toy(lengths=(length,), n_samples=1, context_only=True).load(tokenizer)[0]


def kept_positions(kept: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Sorted positions ([B, H, K]) of the kept keys among the full prefill's keys (exact copies)."""
    distance = torch.cdist(kept.double(), full.double())
    best, index = distance.min(dim=-1)
    assert float(best.max()) <= 1e-5, "a kept key is not one of the prompt's keys"
    return index.sort(dim=-1).values


def cross_check(model, tokenizer, name: str, length: int) -> None:
    """Same kept positions in every layer and head, and the same record through the runner."""
    native, press = PAIRS[name]
    benchmark = Toy(lengths=(length,), n_samples=1, context_only=True)
    # Equal entries: native SnapKV also keeps (and counts) its query window for the re-compressions of
    # decoding, which a byte budget pays for with entries; kvpress's press drops it after the prefill.
    evaluator = Evaluator(model, tokenizer, (native, press), benchmark, budget_unit="entries")
    sample = toy_sample(tokenizer, length)
    records = {r["method"]: r for r in evaluator.run_sample(sample, [native, press], cap=None)}
    ours, theirs = records[native.name], records["kvpress"]
    assert ours["status"] == theirs["status"] == "ok", (ours.get("error"), theirs.get("error"))
    assert ours["prediction"] == theirs["prediction"]
    assert ours["kv_len"] == theirs["kv_len"] and ours["kv_bytes"] >= theirs["kv_bytes"]  # + its window
    assert ours["protocol"] == theirs["protocol"] == "context_only" and theirs["kv_masked"] is False

    # The kept positions, through the same calls the runner makes.
    head = evaluator.prompt(sample).context  # folded into a tiny model's vocabulary
    max_new = sample["max_new_tokens"]
    ids = torch.tensor([head])
    native_method = evaluator.methods[native]
    shared = prefill(model, ids, max_new, needs=native_method.needs())
    forked = shared.cache.fork(native_method, BUDGET, max_new, budget_unit="entries")
    press_run = evaluator.methods[press].prefill_run(model, BUDGET, len(head), max_new, share_prefill=False)
    with press_run.prefill_hooks(model):
        pressed = prefill(model, ids, max_new)
    for layer, (a, b, full) in enumerate(
        zip(forked.layers, pressed.cache.layers, shared.cache.layers, strict=True)
    ):
        mine, kvp = kept_positions(a.keys, full.keys), kept_positions(b.keys, full.keys)
        assert mine.shape[-1] < len(head) and torch.equal(mine, kvp), f"layer {layer}"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")[0], load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("name", list(PAIRS))
def test_native_and_kvpress_keep_the_same_positions_and_answer_alike_on_tiny_llama(tiny, name):
    cross_check(*tiny, name, length=512)


@pytest.mark.parametrize("name", list(PAIRS))
def test_native_and_kvpress_keep_the_same_positions_and_answer_alike_on_the_embedded_model(embedded, name):
    cross_check(*embedded, name, length=512)


def test_masked_presses_save_no_memory_and_shrinking_ones_do(embedded, tmp_path):
    """AdaKV masks keys head-wise: full-size tensors, kv_masked in the record, "[masked]" in the
    tables; SnapKVPress shrinks them for real. (The embedded model: on a random model kvpress's
    search for a key that every question query ignores can fail.)"""
    model, tokenizer = embedded
    specs = (
        MethodSpec("full", 1.0, {}),
        MethodSpec("kvpress", 0.5, {"press": "SnapKVPress"}),
        MethodSpec("kvpress", 0.5, {"press": "AdaKVPress", "press_params": {"press": "SnapKVPress"}}, "ada"),
    )
    evaluator = Evaluator(model, tokenizer, specs, Toy(lengths=(512,), n_samples=1, context_only=True))
    full, snap, ada = evaluator.run_sample(toy_sample(tokenizer, 512), list(specs), cap=4)
    assert full["status"] == snap["status"] == ada["status"] == "ok"
    assert ada["kv_masked"] is True and ada["kv_bytes"] == full["kv_bytes"]
    assert snap["kv_masked"] is False and snap["kv_bytes"] < 0.6 * full["kv_bytes"]
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in model.model.layers)

    import json

    from scripts.reports.tables import load

    job = tmp_path / "exp" / "job"
    job.mkdir(parents=True)
    (job / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (full, snap, ada)))
    labels = set(load([job.parent])["label"])
    assert labels == {"Full cache", "SnapKV (kvpress)", "ada [masked]"}


def test_prefill_decoding_press_also_compresses_while_decoding(tiny):
    """kvpress's decoding wrapper: the prefill press takes the budget, the decoding press keeps the
    cache at target_size every compression_interval steps (native methods do the same by design)."""
    model, tokenizer = tiny
    decoding = {"press": "DecodingPress", "base_press": "KnormPress", "compression_interval": 4}
    both = {"prefilling_press": "SnapKVPress", "decoding_press": {**decoding, "target_size": 64}}
    specs = (
        MethodSpec("kvpress", 0.5, {"press": "SnapKVPress"}),
        MethodSpec("kvpress", 0.5, {"press": "PrefillDecodingPress", "press_params": both}),
    )
    evaluator = Evaluator(model, tokenizer, specs, Toy(lengths=(512,), n_samples=1, ignore_eos=True))
    prefill_only, with_decoding = evaluator.run_sample(
        toy_sample(tokenizer, 512), list(specs), cap=None, ignore_eos=True
    )
    assert prefill_only["kv_bytes"] == with_decoding["kv_bytes"]  # same prefill compression
    assert with_decoding["kv_bytes_final"] < prefill_only["kv_bytes_final"]  # then compressed again


def test_missing_kvpress_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # `import kvpress` now fails
    with pytest.raises(ValueError) as error:
        get_method("kvpress", press="SnapKVPress")
    assert str(error.value) == 'kvpress is not installed: pip install -e ".[kvpress]"'


BAD_ENTRY = "{name: kvpress, variant: bad, params: {press: SnapKVPress, press_params: {window_sz: 3}}}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        # a press name is checked against the schema's list, before torch is imported
        (["method=kvpress", "method.params.press=NoSuchPress"], "press must be one of "),
        # a press's own parameters when the press is built, still before any model loads
        (
            [f"methods=[kvpress,{BAD_ENTRY}]"],
            "method bad (kvpress): kvpress SnapKVPress: unknown parameter(s) window_sz",
        ),
    ],
)
def test_bad_press_and_parameter_exit_2_with_one_line_each_before_loading(tmp_path, overrides, message):
    """model=llama3.1-8b cannot load here (no Hub): exit code 2 and one line for the bad value (an
    unknown press in `method`, a bad press parameter in a `methods` entry) prove nothing loaded."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run.py"), *overrides]
        + ["model=llama3.1-8b", "logger=none", f"results_dir={tmp_path / 'results'}"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("config error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-1500:]
    assert message in errors[0], errors[0]
    assert not (tmp_path / "results").exists()


def test_the_zoo_runs_every_press_or_says_why_not():
    """Every press kvpress exports is in configs/experiment/kvpress_zoo.yaml or in ZOO_SKIPS (with a
    reason), never both; every zoo entry builds."""
    config = yaml.safe_load((ROOT / "configs" / "experiment" / "kvpress_zoo.yaml").read_text())
    entries = [m for m in config["methods"] if isinstance(m, dict) and m["name"] == "kvpress"]
    in_zoo = {entry["params"]["press"] for entry in entries}
    assert in_zoo.isdisjoint(ZOO_SKIPS) and in_zoo | set(ZOO_SKIPS) == set(press_names())
    assert all(reason.strip() for reason in ZOO_SKIPS.values())
    for entry in entries:
        get_method("kvpress", **entry["params"])
    natives = [m for m in config["methods"] if isinstance(m, str)]
    assert "full" in natives and "centroidkv" in natives and config["benchmark"]["context_only"] is True
