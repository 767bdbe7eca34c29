"""A user's own model: a folder saved with `save_pretrained` through `generate` and `eval.calibrate`,
head files keyed by the model's identity, and the model kinds read without torch."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from centroidkv.calibrate import user_head_file
from centroidkv.models.model_names import model_identity, model_kind
from eval import calibrate
from scripts import generate


def save_small_model(folder, tokenizer, layers: int = 2) -> None:
    """A random Llama with the embedded tokenizer's vocabulary, saved with its tokenizer."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from centroidkv.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_generate_on_a_folder_refuses_with_a_calibrate_command_that_then_works(
    tmp_path, monkeypatch, capsys, embedded_tokenizer
):
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    save_small_model(tmp_path / "my model", embedded_tokenizer, layers=8)  # 16 KV heads: one is listed
    (tmp_path / "context.txt").write_text("The sky is green on Tuesdays. " * 300)
    argv = [
        "--model", str(tmp_path / "my model"), "--context", str(tmp_path / "context.txt"),
        "--question", "What colour is the sky?", "--methods", "full,centroidkv,snapkv",
        "--budget", "0.25", "--max-new-tokens", "4", "--json",
    ]  # fmt: skip
    assert generate.main(argv) == 2  # CentroidKV keeps its calibrated heads whole: not calibrated yet
    command = re.search(r"`(python -m eval\.calibrate [^`]*)`", capsys.readouterr().err).group(1)
    assert calibrate.main(shlex.split(command)[3:]) == 0  # the command as printed (quoted path included)
    written = user_head_file(str(tmp_path / "my model"))
    assert written.is_file() and json.loads(written.read_text())["model"] == str(tmp_path / "my model")
    capsys.readouterr()
    assert generate.main(argv) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [a["method"] for a in answers] == ["full", "centroidkv", "snapkv"]
    assert all(a["error"] is None for a in answers), answers
    assert all(a["kv_budget_ratio"] <= 0.26 for a in answers[1:]), answers


def test_head_files_of_two_models_never_collide(tmp_path, embedded_tokenizer):
    """Two folders of one name (other places), a folder whose config changed, a registered model and
    a hub id: each has its own head file."""
    for place in ("a", "b"):
        save_small_model(tmp_path / place / "model", embedded_tokenizer)
    first, second = str(tmp_path / "a" / "model"), str(tmp_path / "b" / "model")
    files = {user_head_file(name) for name in (first, second, "smollm2-135m", "org/model")}
    before = user_head_file(first)
    config = json.loads((tmp_path / "a" / "model" / "config.json").read_text())
    (tmp_path / "a" / "model" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    files.add(user_head_file(first))
    assert len(files) == 5 and before != user_head_file(first)
    assert user_head_file(first) == user_head_file(str(tmp_path / "a" / ".." / "a" / "model"))


@pytest.mark.parametrize(
    ("name", "kind"),
    [("qwen2.5-0.5b", "registered"), ("random-llama3.1-8b:2", "registered"), ("Qwen/Qwen2.5-0.5B", "hub")],
)
def test_model_kinds(name, kind):
    assert model_kind(name) == kind


@pytest.mark.parametrize("name", ["x" * 300, "no-such-model", "./missing/folder", ""])
def test_an_unknown_model_is_one_line_without_raising_on_long_text(name):
    with pytest.raises(ValueError, match="model") as error:
        model_identity(name)
    assert "\n" not in str(error.value) and len(str(error.value)) < 400
