"""docs/design.md's layout names every module of the packages it describes, and only modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("centroidkv", "eval", "baselines", "centroidkv_vllm")
MODULE_SUFFIXES = (".py", ".cpp")
# An entry of the layout: a file or folder name at an even indent of at most 3 levels (deeper lines
# continue the description above them).
ENTRY = re.compile(r"^(?P<indent> {0,6})(?P<name>[\w.]+(?:\.py|\.cpp|/))(?:\s|$)")


def layout_block(text: str) -> list[str]:
    """The lines of the code block under the "Layout" heading."""
    section = text[text.index("## 7. Layout") :]
    start = section.index("```\n") + len("```\n")
    return section[start : section.index("```", start)].splitlines()


def listed_modules(lines: list[str]) -> set[str]:
    """Paths of the module files the layout names under the packages, from the entries' indents."""
    folders: list[str] = []
    modules = set()
    for line in lines:
        entry = ENTRY.match(line)
        if entry is None or len(entry["indent"]) % 2:
            continue
        level, name = len(entry["indent"]) // 2, entry["name"]
        del folders[level:]
        if name.endswith("/"):
            folders.append(name)
        elif folders and folders[0].rstrip("/") in PACKAGES:
            modules.add("".join(folders) + name)
    return modules


def module_files() -> set[str]:
    """Every module file of the packages; a package's __init__.py is described by the package's line."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.suffix in MODULE_SUFFIXES and path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def test_the_layout_lists_exactly_the_module_files():
    listed = listed_modules(layout_block(DESIGN.read_text()))
    existing = module_files()
    assert not existing - listed, (
        f"modules docs/design.md's layout does not list: {sorted(existing - listed)}"
    )
    assert not listed - existing, (
        f"docs/design.md's layout lists modules that do not exist: {sorted(listed - existing)}"
    )


def test_the_layout_reader_finds_nested_modules_and_drops_a_removed_one():
    lines = [
        "eval/                 the evaluation side",
        "  benchmarks/         the base class",
        "    ruler/            RULER",
        "      tasks.py        the task builders",
        "                      continued.py is not an entry",
        "  runner.py           the job loop",
        "scripts/              run.py",
        "  run.py              not a package module",
    ]
    assert listed_modules(lines) == {"eval/benchmarks/ruler/tasks.py", "eval/runner.py"}


def test_the_layout_mentions_the_plugin_tests_and_the_hydra_plugins():
    block = "\n".join(layout_block(DESIGN.read_text()))
    assert "tests_serve/" in block and "hydra_plugins/" in block
