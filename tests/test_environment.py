"""environment.yml (the conda route) must install what `make setup` installs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


def _pip_entries() -> list[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    (pip_section,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    return pip_section


def _normalised(requirement: str) -> tuple[str, str]:
    parsed = Requirement(requirement)
    return re.sub(r"[-_.]+", "-", parsed.name).lower(), str(parsed.specifier)


def test_environment_names_pyproject_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    entries = _pip_entries()
    assert "-e ." in entries, "the environment must install the project itself"
    listed = {_normalised(e) for e in entries if not e.startswith("-") and not e.startswith("torch")}
    expected = {_normalised(r) for r in wanted if Requirement(r).name != "torch"}
    assert listed == expected, f"missing: {sorted(expected - listed)}, extra: {sorted(listed - expected)}"


def test_environment_torch_is_the_makefile_pin_inside_pyproject_range():
    makefile = (ROOT / "Makefile").read_text()
    (make_pin,) = set(re.findall(r"pip install -q (torch==[\w.+]+)", makefile))
    torch_entries = [e for e in _pip_entries() if e.startswith("torch")]
    assert torch_entries == [make_pin]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_range,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert Version(make_pin.split("==")[1]) in torch_range.specifier


def test_environment_python_and_data_packages_match():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    (python,) = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert Version(python.split("=")[1]) in Requirement(f"python{project['requires-python']}").specifier
    # The data-only packages go in with --no-deps, as the Makefile installs them.
    # (the harness's venv, $(PYTHON); the serving venv installs this repository with --no-deps too)
    makefile = (ROOT / "Makefile").read_text()
    (no_deps,) = re.findall(r"\$\(PYTHON\) -m pip install -q --no-deps (.+)", makefile)
    variables = dict(re.findall(r"^(\w+)\s*:?=\s*(.+)$", makefile, flags=re.MULTILINE))
    no_deps = re.sub(r"\$\((\w+)\)", lambda name: variables[name[1]].strip(), no_deps.strip())
    assert f"pip install --no-deps {no_deps}" in (ROOT / "environment.yml").read_text()
