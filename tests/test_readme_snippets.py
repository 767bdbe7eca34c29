"""The README's "Using it from Python" snippets run as written, on the embedded model.

The code run is the README's own text; only three lines are swapped: the placeholder prompt for a
short real one, max_new_tokens for a few tokens, and snippet 2's methods for every registered
native method (kvpress presses compress inside their own prefill and cannot fork one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from centroidkv import get_method, method_names
from centroidkv.decoding import generate_from, needs_of, prefill
from centroidkv.plan import compresses_in_prefill

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Using it from Python"
NEEDLE = "The special magic number for quiet-river is: 4827361."


def python_blocks(section: str = SECTION) -> list[str]:
    """The ```python blocks of a README section (up to the next `## ` heading)."""
    text = README.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], flags=re.DOTALL)


def swap_line(code: str, pattern: str, replacement: str) -> str:
    """`code` with the one line matching `pattern` replaced; fails when the README lost that line."""
    swapped, count = re.subn(pattern, lambda _: replacement, code, count=1, flags=re.MULTILINE)
    assert count == 1, f"the README snippet has no line matching {pattern!r}"
    return swapped


def native_methods() -> list[str]:
    return [name for name in method_names() if not compresses_in_prefill(get_method(name))]


def short_prompt() -> str:
    """About 400 tokens: enough for every method to compress at budget 0.25 (above its sinks and
    recent window), short enough for a quick test."""
    filler = " ".join(f"Line {i}: the river runs quietly past the old mill." for i in range(13))
    more = " ".join(f"Line {i}: the wind moves the tall grass on the hill." for i in range(13, 26))
    return f"{filler} {NEEDLE} {more}\n\nWhat is the special magic number for quiet-river?"


def test_readme_python_snippets_run(capsys):
    first, second = python_blocks()
    first = swap_line(first, r"^prompt = .*$", f"prompt = {short_prompt()!r}")
    first = swap_line(first, r"^max_new_tokens = .*$", "max_new_tokens = 6")
    names = native_methods()
    second = swap_line(second, r"^methods = .*$", f"methods = [get_method(name) for name in {names!r}]")

    namespace: dict = {}
    exec(compile(first, "README snippet 1", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].strip(), out  # an answer, then the sizes

    exec(compile(second, "README snippet 2", "exec"), namespace)
    out = capsys.readouterr().out.splitlines()
    labels = [get_method(name).label for name in names]
    assert [line.split(":")[0] for line in out] == labels, out
    full_answer = out[labels.index(get_method("full").label)]
    # with the chat template the full cache starts answering the question (6 tokens do not reach the number)
    assert "magic number" in full_answer, full_answer


def test_fork_without_needs_names_the_fix(tiny_model):
    ids = torch.arange(10, 300)[None]
    pre = prefill(tiny_model, ids, 4)  # no needs recorded
    with pytest.raises(ValueError, match=r"needs a 'queries' window .*needs=needs_of"):
        generate_from(tiny_model, pre, "snapkv", 0.5, 4)
    with pytest.raises(ValueError, match=r"which the source cache did not record; .*needs=needs_of"):
        generate_from(tiny_model, pre, "h2o", 0.5, 4)
    recorded = prefill(tiny_model, ids, 4, needs=needs_of([get_method("snapkv"), get_method("h2o")]))
    assert generate_from(tiny_model, recorded, "snapkv", 0.5, 4).tokens
