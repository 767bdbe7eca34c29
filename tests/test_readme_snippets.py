"""The README's "Using it from Python" snippets run verbatim, in order, on the embedded model: a
CompressedCache in `model.generate`, forks of one prefill, and CentroidKV as a kvpress press.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from centroidkv import get_method
from centroidkv.plan.decoding import generate_from, needs_of, prefill

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Using it from Python"


def python_blocks(section: str = SECTION) -> list[str]:
    """The ```python blocks of a README section (up to the next `## ` heading)."""
    text = README.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], flags=re.DOTALL)


def test_readme_python_snippets_run(capsys):
    pytest.importorskip("kvpress")
    first, second, _own_model, third = python_blocks()
    namespace: dict = {}
    exec(compile(first, "README snippet 1", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "4827361" in out[0], out  # CentroidKV at 1/4 finds the needle

    exec(compile(second, "README snippet 2", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    labels = [method.label for method in namespace["methods"]]
    assert [line.split(":")[0] for line in out] == labels, out
    full_answer = out[labels.index(get_method("full").label)]
    assert "4827361" in full_answer, full_answer
    ratios = [float(line.split(", ")[1].split()[0]) for line in out]
    assert ratios[0] > 0.9 and all(ratio <= 0.26 for ratio in ratios[1:]), out

    exec(compile(third, "README snippet 3", "exec"), namespace)
    out = capsys.readouterr().out.strip()
    assert out, "the kvpress pipeline with CentroidKVPress answers"


def test_readme_own_model_snippet_runs_on_a_folder_saved_with_save_pretrained(tmp_path, monkeypatch, capsys):
    """The "your own model" block, verbatim, on a small random Llama saved with the embedded tokenizer
    into ./my-model: plain `from_pretrained`, `prepare_model`, a CompressedCache in `generate`."""
    from test_any_model import save_small_model

    from centroidkv.models.loading import load_tokenizer

    torch.manual_seed(0)
    save_small_model(tmp_path / "my-model", load_tokenizer("smollm2-135m"))
    monkeypatch.chdir(tmp_path)
    own_model = python_blocks()[2]
    assert 'folder = "my-model"' in own_model
    exec(compile(own_model, "README snippet: your own model", "exec"), {})
    answer_and_ratio = capsys.readouterr().out.strip()
    assert float(answer_and_ratio.split()[-1]) == pytest.approx(0.25, abs=0.01), answer_and_ratio


def test_fork_without_needs_names_the_fix(tiny_model):
    ids = torch.arange(10, 300)[None]
    pre = prefill(tiny_model, ids, 4)  # no needs recorded
    with pytest.raises(ValueError, match=r"needs a 'queries' window .*needs=needs_of"):
        generate_from(tiny_model, pre, "snapkv", 0.5, 4)
    with pytest.raises(ValueError, match=r"which the source cache did not record; .*needs=needs_of"):
        generate_from(tiny_model, pre, "h2o", 0.5, 4)
    recorded = prefill(tiny_model, ids, 4, needs=needs_of([get_method("snapkv"), get_method("h2o")]))
    assert generate_from(tiny_model, recorded, "snapkv", 0.5, 4).tokens
