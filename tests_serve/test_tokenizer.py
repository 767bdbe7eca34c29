"""One tokenizer in both venvs: the converted embedded model's files give, under this venv's
transformers (vLLM's), the ids the harness's own venv gives (centroidkv.models.tokenizer_files). Before,
5.19 obeyed the GGUF conversion's CodeLlamaTokenizer and put <|endoftext|> between every two words."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from centroidkv_vllm.__main__ import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
HARNESS_PYTHON = ROOT / ".venv" / "bin" / "python"
PARAGRAPH = (ROOT / "docs" / "design.md").read_text()[:3000]
CHAT = [{"role": "user", "content": "What is the capital of France?  Answer\tin one word.\n\n"}]

IDS_IN_THE_HARNESS = """
import json, sys
from centroidkv import load_tokenizer
tokenizer = load_tokenizer("smollm2-135m")
paragraph, chat = json.loads(sys.stdin.read())
print(json.dumps([tokenizer(paragraph)["input_ids"],
                  list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))]))
"""


@pytest.mark.skipif(not HARNESS_PYTHON.is_file(), reason="the harness's venv (make setup) is not built")
def test_the_embedded_models_ids_are_the_harnesss_under_the_serving_transformers():
    harness = subprocess.run(  # converts (or rewrites an older conversion's tokenizer) first
        [str(HARNESS_PYTHON), "-c", IDS_IN_THE_HARNESS],
        input=json.dumps([PARAGRAPH, CHAT]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert harness.returncode == 0, harness.stderr[-2000:]
    paragraph_ids, chat_ids = json.loads(harness.stdout.splitlines()[-1])
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    assert tokenizer("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    assert tokenizer(PARAGRAPH)["input_ids"] == paragraph_ids
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(chat) == chat_ids
    assert tokenizer.decode(paragraph_ids) == PARAGRAPH
