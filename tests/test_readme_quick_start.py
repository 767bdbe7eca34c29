"""The README's front door (issue 54, item 1): a quick start of three commands in the order a newcomer
needs them, each saying how long it takes; the test command is the one CI runs; a tour, not the
results (those are in docs/results.md, every source named in this repository)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def quick_start_commands() -> list[tuple[str, str]]:
    """(command, comment) of each line of the first bash block under "## Quick start"."""
    section = README[README.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    return [tuple(part.strip() for part in line.split("#", 1)) for line in block.strip().splitlines()]


def test_the_quick_start_is_setup_and_demo_then_the_main_job_then_the_tests_each_with_its_time():
    lines = quick_start_commands()
    assert [command for command, _ in lines] == [
        "make setup && make demo",
        "make reproduce-ruler",
        "make test",
    ]
    for command, comment in lines:
        assert re.search(r"\d+ (min|s)\b", comment), f"{command!r} says not how long it takes: {comment!r}"


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make")]
    assert ci == ["make test"] and quick_start_commands()[-1][0] == "make test"


def test_the_readme_is_a_tour_and_every_source_it_cites_is_in_the_repository():
    assert len(README.splitlines()) <= 250, len(README.splitlines())
    assert "not in this repository" not in README
    for document in ("README.md", "docs/results.md"):
        assert "issue notes" not in (ROOT / document).read_text(), document
