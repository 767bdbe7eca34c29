"""Results folders the runner cannot use are one line before any work: a folder where it keeps a
file, an experiment name too long for the file system (issue 29, D10, D12, D13)."""

from __future__ import annotations

import pytest
from test_harness import config_error_line
from test_job_safety import TINY

from eval.records import ResultsFolderError, check_results_folder
from eval.run_config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------- D10, D12. a folder where the runner keeps a file
@pytest.mark.parametrize("name", [".lock", "records.jsonl"])
def test_a_folder_named_like_a_job_file_is_one_line_before_any_work(tmp_path, name):
    """Before: a `.lock` folder was an IsADirectoryError traceback from check_not_running; a
    `records.jsonl` folder was refused as holding "results without a saved identity"."""
    from eval.sweep import plan

    args = [
        *TINY,
        "method=full",
        "benchmark.n_samples=1",
        "benchmark.max_new_tokens=2",
        f"results_dir={tmp_path}",
    ]
    (job_dir,) = [cfg.job_dir for cfg in plan(args)]
    (job_dir / name).mkdir(parents=True)
    with pytest.raises(ConfigError) as error:
        plan(args)
    assert error.value.lines == [f"{job_dir / name} is a folder, where the runner keeps a file; remove it"]
    assert [p.name for p in job_dir.iterdir()] == [name]


# ------------------------------------------------------------ D13. an experiment name too long
def test_an_experiment_name_too_long_for_the_file_system_is_one_line_and_creates_nothing(tmp_path):
    """Before: refused by the lock's mkdir ("File name too long"), after the results folder was made."""
    results = tmp_path / "results"
    line = config_error_line(results, ["method=full", "experiment_name=" + "a" * 300])
    assert line == "experiment_name: 300 characters, more than a folder name may have (255)"
    with pytest.raises(ResultsFolderError, match="more than a file system allows"):
        check_results_folder(results / ("b" * 300) / "job")
    assert not results.exists()
