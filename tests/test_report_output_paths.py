"""Tables and figures never write outside their folder: record fields never become paths, and a
linked output folder is refused (issue 29, S1, D1)."""

from __future__ import annotations

import pytest
from test_bad_records import files_under, toy_records, write_job

from scripts.reports import figures, table_files, tables

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------- S1. record fields never become paths
ESCAPE = "../../../../escape/PWNED"


def test_a_record_naming_its_experiment_with_dot_dots_writes_nothing_outside_out(tmp_path):
    """Before: figures.py wrote escape/PWNED_toy_*.png/.pdf outside --out, and tables.py (two
    experiments) escape/PWNED_toy_*.md/.tex (exit 0). Now the names are reduced to safe ones."""
    out = tmp_path / "out" / "a" / "b" / "c"
    escape = tmp_path / "out" / "escape"  # where out/a/b/c/<folder>/../../../../escape lands
    escape.mkdir(parents=True)
    bad = write_job(tmp_path / "results" / "bad" / "job", toy_records(ESCAPE))
    good = write_job(tmp_path / "results" / "good" / "job", toy_records("other"))
    assert figures.main([str(bad), "--out", str(out / "figures")]) == 0
    assert tables.main([str(bad), str(good), "--out", str(out / "tables")]) == 0
    assert list(escape.iterdir()) == []
    written = [p for p in files_under(tmp_path) if not p.is_relative_to(tmp_path / "results")]
    assert written and all(p.is_relative_to(out) for p in written)
    prefix = table_files.safe_name(ESCAPE)
    assert prefix.startswith("escape_PWNED-") and "/" not in prefix and not prefix.startswith(".")
    assert (out / "figures" / f"{prefix}_toy_accuracy_vs_budget.png").is_file()
    assert (out / "tables" / f"{prefix}_toy_budget0.5.md").is_file()
    assert (out / "tables" / "other_toy_budget0.5.md").is_file()  # a plain name is kept as it is


def test_a_record_naming_its_benchmark_with_dot_dots_writes_nothing_outside_out(tmp_path):
    experiment = write_job(tmp_path / "results" / "exp" / "job", toy_records("exp", benchmark="../../b/X"))
    out = tmp_path / "out"
    assert figures.main([str(experiment), "--out", str(out / "figures")]) == 0
    assert tables.main([str(experiment), "--out", str(out / "tables")]) == 0
    name = table_files.safe_name("../../b/X")
    assert (out / "figures" / f"exp_{name}_accuracy_vs_budget.png").is_file()
    assert (out / "tables" / f"{name}_budget0.5.md").is_file()
    written = [p for p in files_under(tmp_path) if not p.is_relative_to(tmp_path / "results")]
    assert all(p.parent in (out / "figures", out / "tables") for p in written)


def test_safe_names_are_plain_and_never_collide_and_output_paths_stay_in_their_folder(tmp_path):
    assert table_files.safe_name("reproduce_ruler_cpu") == "reproduce_ruler_cpu"
    names = [table_files.safe_name(text) for text in ("..", ".", "a/b", "a_b/", "/etc/passwd", "x" * 300, "")]
    assert all(table_files.PLAIN_NAME.fullmatch(name) for name in names)
    assert len(set(names)) == len(names)  # "a/b" and "a_b/" reduce to different names
    with pytest.raises(table_files.OutputError, match="not a plain file name"):
        table_files.output_path(tmp_path, "../x.md")


# ----------------------------------------------------------------- D1. a linked output folder
def test_a_tables_or_figures_folder_that_is_a_link_is_refused(tmp_path, capsys):
    """Before: `ln -s /elsewhere <exp>/tables` made tables.py write into /elsewhere (exit 0)."""
    experiment = write_job(tmp_path / "results" / "exp" / "job", toy_records("exp"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (experiment / "tables").symlink_to(elsewhere, target_is_directory=True)
    assert tables.main([str(experiment)]) == 2
    assert figures.main([str(experiment), "--out", str(experiment / "tables")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {experiment / 'tables'} is a symbolic link; not writing through it "
                     "(remove it or give another --out)"] * 2  # fmt: skip
    assert list(elsewhere.iterdir()) == []
