"""Issue 54, item 7: the venvs are installed without setuptools' "compat editable mode is
transitional" warning, and `scripts/generate.py --help` answers without importing torch, even before
any run has cached the method schema (before: it built the schema first, seconds under load)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_editable_installs_use_no_transitional_mode():
    """`editable_mode=compat` printed the warning box; `package-dir = {"" = "."}` gives the same one
    static path entry to the project root (scripts/, tests/, centroidkv_vllm/ import as before)."""
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "pip install" in line and " -e " in line]
    assert len(installs) == 2 and not any("editable_mode" in line for line in installs), installs
    assert '\npackage-dir = {"" = "."}\n' in (ROOT / "pyproject.toml").read_text()


def test_generate_help_imports_no_torch_with_no_cached_schema(tmp_path):
    check = (
        "import runpy, sys\n"
        "sys.argv = ['scripts/generate.py', '--help']\n"
        "try:\n    runpy.run_path('scripts/generate.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "CENTROIDKV_CACHE": str(tmp_path / "empty-cache")}
    shown = subprocess.run(
        [sys.executable, "-c", check],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "--methods" in shown.stdout and "methods: listed here once" in shown.stdout, shown.stdout
    assert shown.stdout.strip().endswith("torch imported: False"), shown.stdout[-300:]
