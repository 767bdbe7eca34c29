"""No code from a model folder ever runs: a folder whose config.json or tokenizer_config.json names code
of its own (`auto_map`), or whose model type transformers does not know, is refused in one line by
every command before anything loads, even when standard input answers "y" to transformers' question;
and every load passes `trust_remote_code=False`. A folder whose tokenizer outruns the model's
embeddings is one line at load too."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

import centroidkv.models.loading as models
from centroidkv.models.model_names import model_kind
from centroidkv.schema import build_schema, fingerprint, schema_path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2}
EVIL_CONFIG = {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilForCausalLM"}


def evil_folder(tmp_path: Path, where: str) -> tuple[Path, Path]:
    """A model folder whose `where` (config.json or tokenizer_config.json) names its evil_code.py,
    which creates a marker file when it runs; the folder and the marker's path."""
    folder, marker = tmp_path / "m", tmp_path / "PWNED"
    folder.mkdir()
    (folder / "evil_code.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    if where == "config.json":
        (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": EVIL_CONFIG}))
    else:
        (folder / "config.json").write_text(json.dumps(LLAMA))
        auto_map = {"AutoTokenizer": ["evil_code.EvilTokenizer", None]}
        (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    return folder, marker


def cache_with_schema(cache: Path) -> None:
    """A new cache folder holding this process's method schema (an empty one would be rebuilt, with
    torch, by each command line)."""
    cache.mkdir(parents=True, exist_ok=True)
    schema = {"fingerprint": fingerprint(), "schema": build_schema()}
    (cache / schema_path().name).write_text(json.dumps(schema, default=str))


COMMANDS = {
    "generate": [
        str(ROOT / "scripts" / "generate.py"),
        "--model",
        "{m}",
        "--prompt",
        "hi",
        "--methods",
        "full",
    ],
    "run.py": [
        str(ROOT / "scripts" / "run.py"),
        "model={m}",
        "benchmark=toy",
        "logger=none",
        "benchmark.n_samples=1",
    ],
    "calibrate": ["-m", "eval.calibrate", "--model", "{m}"],
}


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_naming_its_own_code_is_refused_and_the_code_never_runs(tmp_path, command, where):
    """Before: transformers asked "run the custom code? [y/N]" on standard input, `yes y` answered,
    and the folder's code ran (the marker was created; its copy landed in the modules cache)."""
    folder, marker = evil_folder(tmp_path, where)
    argv = [arg.replace("{m}", str(folder)) for arg in COMMANDS[command]]
    cache_with_schema(tmp_path / "cache")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # where transformers would copy the code to
        "CENTROIDKV_CACHE": str(tmp_path / "cache"),
    }
    result = subprocess.run(
        [sys.executable, *argv], input="y\n" * 20, capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert not marker.exists() and not (tmp_path / "hf").exists()
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "auto_map" in lines[0] and f"its {where}" in lines[0], result.stderr


def test_a_folder_of_a_model_type_transformers_does_not_know_is_refused(tmp_path):
    """Before: accepted as a folder; the load then failed, deep in transformers."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "my-own-arch"}))
    with pytest.raises(ValueError, match=r"model_type 'my-own-arch' is not one transformers knows"):
        model_kind(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert model_kind(str(tmp_path)) == "folder"


def test_a_tokenizer_loaded_directly_never_runs_the_folders_code(tmp_path, monkeypatch):
    """Behind the folder check, the loaders themselves pass trust_remote_code=False: transformers
    refuses instead of asking. Before: its question, answered "y", ran the code."""
    folder, marker = evil_folder(tmp_path, "tokenizer_config.json")
    modules = tmp_path / "modules"  # where transformers would copy the code to (read at its import)
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(modules))
    monkeypatch.setattr("builtins.input", lambda *args: "y")  # piped input answering transformers
    assert models._folder_tokenizer(folder) is None  # refused by transformers, no tokenizer
    assert not marker.exists() and not modules.exists()


def from_pretrained_calls_without_trust_remote_code() -> list[str]:
    """Every `<X>.from_pretrained(...)` call in the harness's code that does not pass
    trust_remote_code=False (`_from_hub` passes it for the loaders handed to it)."""
    found = []
    for folder in ("centroidkv", "eval", "scripts", "baselines", "centroidkv_vllm"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"
                    and not any(
                        k.arg == "trust_remote_code" and getattr(k.value, "value", None) is False
                        for k in node.keywords
                    )
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_load_passes_trust_remote_code_false(monkeypatch):
    """Before: no load passed it (transformers then asks on standard input)."""
    assert from_pretrained_calls_without_trust_remote_code() == []
    seen = {}
    models._from_hub(lambda repo, **kwargs: seen.update(kwargs), "org/name")
    assert seen == {"trust_remote_code": False}


def test_a_tokenizer_with_more_tokens_than_embeddings_is_one_line_at_load(tmp_path):
    """Before: loaded; the first prompt with a high token id was a 64-line IndexError mid-run."""
    tokenizer = models.load_tokenizer("smollm2-135m")  # 49,152 tokens
    config = LlamaConfig(
        vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        models.load_model(str(tmp_path), device="cpu")
    assert str(error.value) == (
        f"{tmp_path}: its tokenizer has {tokenizer.vocab_size} tokens, more than the model's 512 "
        "embeddings (save the model's own tokenizer beside it)"
    )


def test_the_embedded_models_own_folder_loads_with_its_few_added_tokens_past_the_embeddings():
    """The converted SmolLM2 lists 5 added special tokens past its 49,152 embeddings: still its own."""
    folder = models.converted_dir("smollm2-135m")
    model, tokenizer = models.load_model(str(folder), device="cpu")
    assert len(tokenizer) > model.get_input_embeddings().num_embeddings == tokenizer.vocab_size
