"""The README's serving example (`serve_example.py`, vLLM's own `LLM` with the plugin), run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_engine import ENV, needs_model

DEFAULT_PROCESSES = {k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}

ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    """The first Python block after the README's line that introduces `serve_example.py`."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("save as `serve_example.py`") :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@needs_model
def test_the_readme_serving_example_runs_with_the_plugin_and_frees_blocks(tmp_path):
    script = tmp_path / "serve_example.py"
    script.write_text(readme_example())
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=DEFAULT_PROCESSES,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "centroidkv: plugin on" in log and "the scheduler frees merged blocks" in log, log[-3000:]
    assert re.search(r"compressed from \d+ to \d+ entries", log), log[-3000:]
    text = proc.stdout.strip()  # the generated text, readable: no byte-level symbols, English words
    assert text and not re.search("[\u0120\u010a]", text), log[-3000:]
    assert len(re.findall(r"\b[a-z]{3,}\b", text)) >= 5, text
