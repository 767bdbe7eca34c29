"""Calibration files and the calibrate command line (issue 19, items 5-8).

5. A head file of another shape (layers x KV heads), or with values of the wrong type, is refused at
   validation, before any model loads.
6. `heads_file=clustering` keys the file of a random model by its depth (`random-llama3.1-8b:2` and `:4`
   never share one).
7. The head file a run reads, with its content hash, is in the job's identity and in every record.
8. `python -m eval.calibrate`: one line and exit 2 for an unwritable folder, a budget below the
   protected windows and an unloadable model, before any work; `--help` is fast and shows defaults.
Issue 18, item 3: outlier heads are resolved when a model loads, never inside a compression: `auto`
without a head file is one line naming the calibrate command (no tokenizer, no prefill), and the
runner calibrates it up front.

Everything here is fast: tiny or meta-device models and fake head files in tmp_path; no calibration
of a real model runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_harness import TINY, composed, run_cfg

import centroidkv.calibrate
import centroidkv.head_scores
import centroidkv.models.loading
import eval.calibrate as calibrate
from centroidkv import CompressedCache, get_method
from centroidkv.calibrate import (
    CalibrationMissing,
    head_file_for,
    listed_heads_for,
    packaged_head_file,
    read_head_file,
    user_head_file,
)
from centroidkv.models.loading import load_model, model_shape
from eval.calibrate import main
from eval.config import build_run_config
from eval.run_config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache directory for user calibrations (not for tests that load the embedded
    tokenizer: its converted model lives there too)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("CENTROIDKV_CACHE", str(folder))
    return folder


def head_data(model: str, n_layers: int, n_kv_heads: int, **changes) -> dict:
    """The content of a head file with distinct errors (the last head is the worst)."""
    errors = [
        [0.1 + 0.01 * (layer * n_kv_heads + head) for head in range(n_kv_heads)] for layer in range(n_layers)
    ]
    data = dict(model=model, budget=0.25, fraction=0.04, n_layers=n_layers, n_kv_heads=n_kv_heads)
    return {**data, "errors": errors, "outliers": [], **changes}


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def config_errors(tmp_path: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as error:
        run_cfg(tmp_path, overrides)
    return error.value.lines


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded")


# --------------------------------------------------------------------------- 5: shape and types
def test_model_shapes_are_known_without_loading_weights():
    assert model_shape("tiny-llama") == (2, 2)
    assert model_shape("smollm2-135m") == (30, 3)
    assert model_shape("random-llama3.1-8b") == (32, 8)
    assert model_shape("random-llama3.1-8b:2") == (2, 8)
    assert model_shape("random-qwen2-7b") == (28, 4)
    shape = read_head_file(packaged_head_file("smollm2-135m"))
    assert (shape["n_layers"], shape["n_kv_heads"]) == model_shape("smollm2-135m")
    # A hub model: from the local Hugging Face cache's config.json, or unknown (never downloaded).
    assert model_shape("llama3.1-8b") in (None, (32, 8))


def test_a_head_file_of_another_shape_is_refused_at_validation(tmp_path, monkeypatch):
    monkeypatch.setattr(centroidkv.models.loading, "load_model", no_model)
    path = write(tmp_path / "heads.json", head_data("tiny-llama", 3, 2))  # tiny-llama is 2 x 2
    params = [f"method.params.heads_file={path}", "method.params.heads_fraction=0.25"]
    lines = config_errors(tmp_path, ["method=centroidkv", *params])
    assert len(lines) == 1 and "calibrated on 'tiny-llama' (3 x 2" in lines[0] and "(2 x 2)" in lines[0]
    write(path, head_data("tiny-llama", 2, 2))  # the right shape validates
    run_cfg(tmp_path, ["method=centroidkv", *params])


def test_an_auto_file_of_another_shape_is_refused_at_validation(tmp_path, cache):
    # A file left by a 3-layer calibration where the 2-layer model's file is looked for.
    write(user_head_file("random-llama3.1-8b:2"), head_data("random-llama3.1-8b:2", 3, 8))
    lines = config_errors(tmp_path, ["model.name=random-llama3.1-8b:2", "method=centroidkv"])
    assert len(lines) == 1 and "(3 x 8 layers x KV heads), not 'random-llama3.1-8b:2' (2 x 8)" in lines[0]


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"errors": [[0.1, "x"], [0.2, 0.3]]}, "matrix of finite numbers"),
        ({"errors": [[0.1, None], [0.2, 0.3]]}, "matrix of finite numbers"),
        ({"errors": [[0.1, True], [0.2, 0.3]]}, "matrix of finite numbers"),
        ({"errors": [[0.1, float("nan")], [0.2, 0.3]]}, "matrix of finite numbers"),
        ({"errors": [[0.1, 0.2], 0.3]}, "matrix of finite numbers"),
        ({"errors": "0.1"}, "matrix of finite numbers"),
        ({"errors": [[0.1], [0.2]]}, "2 x 2"),
        ({"n_layers": "2"}, "wrong type of n_layers"),
        ({"n_kv_heads": 2.0}, "wrong type of n_kv_heads"),
        ({"budget": "0.25"}, "wrong type of budget"),
        ({"fraction": None}, "wrong type of fraction"),
        ({"model": 3}, "wrong type of model"),
    ],
)
def test_a_head_file_with_values_of_the_wrong_type_is_one_line(tmp_path, changes, fragment):
    path = write(tmp_path / "heads.json", {**head_data("tiny-llama", 2, 2), **changes})
    with pytest.raises(ValueError, match="heads_file") as error:
        read_head_file(path)
    assert fragment in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match=fragment):  # and so is the method that names it
        get_method("centroidkv", heads_file=str(path))


# --------------------------------------------------------------------------- 6: random models by depth
def test_auto_keys_a_random_model_s_file_by_its_depth(cache, monkeypatch):
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    two, _ = load_model("random-llama3.1-8b:2", device="meta")  # shapes only, no weights
    four, _ = load_model("random-llama3.1-8b:4", device="meta")
    assert (two.centroidkv_name, four.centroidkv_name) == ("random-llama3.1-8b:2", "random-llama3.1-8b:4")
    path = write(user_head_file(two.centroidkv_name), head_data("random-llama3.1-8b:2", 2, 8))
    assert path.name == "random-llama3.1-8b-2layers.json"
    assert head_file_for("random-llama3.1-8b:2") == path and head_file_for(four.centroidkv_name) is None
    assert listed_heads_for(two, "clustering", 0.25) == {1: [4, 5, 6, 7]}  # the 4 worst of 16
    assert user_head_file("random-llama3.1-8b:32") == user_head_file("random-llama3.1-8b")  # one model
    # :4 has no file of its own: refused with one line, never read the 2-layer file.
    with pytest.raises(CalibrationMissing, match="random-llama3.1-8b-4layers.json"):
        listed_heads_for(four, "clustering", 0.25)


# --------------------------------------------------------------------------- 7: identity and records
def test_a_user_calibration_changes_the_job_identity(tmp_path, cache):
    overrides = ["model.name=smollm2-135m", "method=centroidkv"]
    shipped = run_cfg(tmp_path, overrides)[0].identity()["methods.centroidkv.heads_file_read"]
    assert shipped.startswith("centroidkv/data/outlier_heads_smollm2-135m.json sha256:")
    data = read_head_file(packaged_head_file("smollm2-135m"))
    write(user_head_file("smollm2-135m"), {**data, "errors": [[0.5] * 3] * 30})  # e.g. --fraction 0
    user = run_cfg(tmp_path, overrides)[0].identity()["methods.centroidkv.heads_file_read"]
    assert user.startswith("<cache>/outlier_heads/smollm2-135m.json sha256:") and user != shipped
    write(user_head_file("smollm2-135m"), {**data, "errors": [[0.25] * 3] * 30})
    assert run_cfg(tmp_path, overrides)[0].identity()["methods.centroidkv.heads_file_read"] != user
    assert get_method("snapkv").identity_fields("smollm2-135m") == {}  # nothing by default


def test_every_record_names_the_head_file_of_the_job_identity(tmp_path):
    from eval.records import read_records
    from eval.runner import config_yaml_of, run_job

    path = write(tmp_path / "heads.json", head_data("tiny-llama", 2, 2))
    overrides = [
        "method=centroidkv",
        f"method.params.heads_file={path}",
        "method.params.heads_fraction=0.25",
    ]
    cfg = build_run_config(composed([*TINY, f"results_dir={tmp_path}", "benchmark.n_samples=1", *overrides]))
    run_job(cfg, config_yaml_of(cfg, None))
    named = cfg.identity()["methods.centroidkv.heads_file_read"]
    assert named.startswith(f"{path} sha256:")
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert records and all(r["heads_file_read"] == named for r in records)
    saved = (cfg.job_dir / "config.yaml").read_text()
    assert "methods.centroidkv.heads_file_read" in saved


def test_the_readme_documents_the_cache_directory():
    readme = (ROOT / "README.md").read_text()
    assert "CENTROIDKV_CACHE" in readme and "heads_file_read" in readme


# --------------------------------------------------------------------------- 8: the command line
def refusal(capsys, argv: list[str]) -> str:
    """The one stderr line `calibrate` refuses `argv` with (exit code 2)."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_unwritable_folder_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(centroidkv.models.loading, "load_model", no_model)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CENTROIDKV_CACHE", str(blocker / "cache"))
    line = refusal(capsys, ["--model", "random-llama3.1-8b:1"])
    assert line.startswith(
        f"calibrate: cannot write {blocker}/cache/outlier_heads/random-llama3.1-8b-1layers.json"
    )
    line = refusal(capsys, ["--model", "random-llama3.1-8b:1", "--out", str(blocker / "heads.json")])
    assert line.startswith(f"calibrate: cannot write {blocker}/heads.json")


def test_a_budget_below_the_protected_windows_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(centroidkv.models.loading, "load_model", no_model)
    line = refusal(capsys, ["--model", "random-llama3.1-8b:1", "--tokens", "256"])
    assert "keeps 64 entries, fewer than its 81 protected" in line and "at least 324" in line


def test_a_hub_model_offline_is_one_line(tmp_path, cache):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "CENTROIDKV_CACHE": str(cache),
    }
    done = subprocess.run(
        [sys.executable, "-m", "eval.calibrate", "--model", "llama3.1-8b"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("calibrate: cannot load llama3.1-8b: ")


def test_help_is_light_and_shows_every_default(capsys):
    probe = "import sys, eval.calibrate; print(sorted(m for m in ('torch', 'tqdm', 'transformers') if m in sys.modules))"
    imported = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert imported.stdout.strip() == "[]", imported.stdout + imported.stderr
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("smollm2-135m", "0.25", "0.04", "clustering", "4096", "None"):
        assert f"(default: {default})" in text


def test_a_job_that_calibrates_on_first_use_resumes_with_the_written_file(
    tmp_path, monkeypatch, capsys, own_cache
):
    """`auto` without a file: the runner calibrates when the model loads, saying so in one line, and
    the identity it saves names the written file, so a resumed job matches it. (The calibration is
    replaced by a fake head file: the tiny model's vocabulary cannot take the essays' tokens, and the
    test is about the job.)"""
    from eval.records import read_records
    from eval.runner import config_yaml_of, run_job

    monkeypatch.setattr(calibrate, "calibrate", lambda model, name, score: head_data(name, 2, 2))
    monkeypatch.setattr(calibrate, "check_calibratable", lambda name: None)  # the fake takes no essays
    overrides = ["method=centroidkv", "method.params.heads_fraction=0.25", "budget_unit=entries"]
    cfg = build_run_config(composed([*TINY, f"results_dir={tmp_path}", "benchmark.n_samples=1", *overrides]))
    assert cfg.identity()["methods.centroidkv.heads_file_read"].endswith(
        "tiny-llama.json (not calibrated yet)"
    )
    run_job(cfg, config_yaml_of(cfg, None))
    assert "no clustering head calibration for 'tiny-llama' yet; calibrating" in capsys.readouterr().err
    named = cfg.identity()["methods.centroidkv.heads_file_read"]
    assert named.startswith("<cache>/outlier_heads/tiny-llama.json sha256:")
    records, _ = read_records(cfg.job_dir / "records.jsonl")
    assert records and all(r["heads_file_read"] == named for r in records)
    (cfg.job_dir / "done.json").unlink()  # as if killed: the rerun resumes, its identity matches
    assert run_job(cfg, config_yaml_of(cfg, None)) is not None


def test_a_compression_never_calibrates_auto_without_a_file_is_one_line(cache, monkeypatch):
    """Issue 18, item 3: no compression loads a tokenizer or runs a prefill. With every calibration
    entry point made to fail, `auto` on a model without a head file stops at once with one line
    naming the command that writes it; once the file is there, the same compression keeps its worst
    head whole."""

    def forbidden(*args, **kwargs):
        raise AssertionError("calibration ran inside a compression")

    monkeypatch.setattr(calibrate, "calibrate", forbidden)
    monkeypatch.setattr(centroidkv.head_scores, "calibrate_heads", forbidden)
    monkeypatch.setattr(centroidkv.head_scores, "head_errors", forbidden)
    monkeypatch.setattr(centroidkv.models.loading, "load_tokenizer", forbidden)
    model, _ = load_model("tiny-llama")
    method = get_method("centroidkv", chunk_size=32, heads_fraction=0.25)  # 1 head of 2 x 2
    ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(0))

    def compressed() -> CompressedCache:
        cache = CompressedCache(method, budget=0.5, max_new_tokens=0, budget_unit="entries")
        with torch.inference_mode():
            model(ids, past_key_values=cache)
        return cache

    with pytest.raises(CalibrationMissing) as missing:
        compressed()
    message = str(missing.value)
    assert (
        "\n" not in message and "`python -m eval.calibrate --model tiny-llama --score clustering`" in message
    )
    write(user_head_file("tiny-llama"), head_data("tiny-llama", 2, 2))  # the last head is the worst
    cache = compressed()
    assert cache.layers[0].group("whole") is None and cache.layers[1].group("whole").heads.tolist() == [1]
    assert cache.layers[1].keys.shape[-2] == 150  # the other head was compressed to the budget


def test_a_jobs_first_use_calibration_of_a_tiny_model_is_refused_in_one_line(tmp_path, capsys, own_cache):
    """Issue 53, defect 4: a tiny model's 512-token vocabulary cannot take the essays' tokens; the
    runner refuses to calibrate it with the command line's check (one line), instead of an
    IndexError from inside the calibration, and writes no head file."""
    from eval.runner import SetupError, config_yaml_of, run_job

    overrides = ["method=centroidkv", "method.params.heads=budget", "method.params.heads_fraction=0.5"]
    cfg = build_run_config(composed([*TINY, f"results_dir={tmp_path}", "benchmark.n_samples=1", *overrides]))
    with pytest.raises(SetupError) as refused:
        run_job(cfg, config_yaml_of(cfg, None))
    assert str(refused.value).splitlines() == [
        "ValueError: tiny-llama: tiny models have no tokenizer to calibrate on; "
        "give heads_file=<a head file>, or heads=none"
    ]
    assert not (own_cache / "outlier_heads").exists() or not any((own_cache / "outlier_heads").iterdir())
    assert "calibrating on the dev essays" not in capsys.readouterr().err
