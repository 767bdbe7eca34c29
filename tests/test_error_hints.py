"""Hints that say what is wrong: a parameter the method lacks is named, not suggested back; an
unparsable config.yaml is not called an older run (issue 39, D10)."""

from __future__ import annotations

import pytest
from test_bad_records import finished_job

from centroidkv import schema
from eval.records import JobMismatch
from eval.runner import config_yaml_of, run_job
from eval.schema import known_keys, missing_param_hint, suggestion

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ D10. hints that say what is wrong
def test_a_parameter_the_method_lacks_is_named_not_suggested_back():
    """Before: `methods=[snapkv] method.params.window_size=-5` answered "did you mean
    method.params.window_size=-5?", the input itself."""
    root = {"method": {"name": "centroidkv", "params": {}}}
    built = schema.build_schema()
    line = missing_param_hint("method.params.window_size", built, root)
    assert line.startswith("centroidkv has no parameter window_size; its parameters are n_sink, n_recent,")
    assert line.endswith("(window_size is a parameter of snapkv, pyramidkv)")
    keys = known_keys(built, root)
    assert "method.params.window_size" not in suggestion("method.params.window_size", "-5", keys)
    assert "did you mean n_recent?" in missing_param_hint("method.params.n_recnt", built, root)


def test_an_unparsable_config_yaml_is_not_called_an_older_run(tmp_path):
    cfg, raw, records = finished_job(tmp_path)
    (cfg.job_dir / "done.json").unlink()
    (cfg.job_dir / "config.yaml").write_text("identity: [unclosed\n")
    with pytest.raises(JobMismatch, match=r"its config.yaml cannot be read \(") as error:
        run_job(cfg, config_yaml_of(cfg, raw))
    assert "older run" not in str(error.value)
