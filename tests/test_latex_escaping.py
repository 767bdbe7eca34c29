"""LaTeX tables from records: every special character is escaped, a variant naming a LaTeX command
is printed, not run (issue 39, S1)."""

from __future__ import annotations

import pytest
from test_bad_records import toy_records, write_job

from scripts.reports import tables
from scripts.reports.latex import LATEX_SPECIALS, latex_escape

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ S1. LaTeX from records
INJECTION = r"\input{/etc/passwd}"


def test_every_latex_special_character_is_escaped():
    escaped = latex_escape("".join(LATEX_SPECIALS) + "\nnext")
    assert escaped == "".join(LATEX_SPECIALS.values()) + " next"
    for char in "{}$#^~%&_<>|":  # none left bare: each one only as part of its escape
        assert escaped.count(char) == "".join(LATEX_SPECIALS.values()).count(char)


def test_a_variant_naming_a_latex_command_is_printed_not_run(tmp_path):
    """Before: a record whose variant was `\\input{/etc/passwd}` reached tables/*.tex verbatim."""
    records = toy_records("exp")
    for record in records:
        record["variant"] = INJECTION if record["method"] == "snapkv" else record["variant"]
        record["task"] = "a$b#c^d~e"
    folder = write_job(tmp_path / "results" / "exp" / "job", records)
    assert tables.main([str(folder), "--out", str(tmp_path / "tables")]) == 0
    tex = [path.read_text() for path in sorted((tmp_path / "tables").glob("*.tex"))]
    assert tex and any(r"\textbackslash{}input\{/etc/passwd\}" in text for text in tex)
    assert not any(r"\input{" in text or "a$b" in text for text in tex)
