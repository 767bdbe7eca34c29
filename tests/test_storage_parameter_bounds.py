"""Storage parameters are bounded in the torch-free check, and a huge group is one line (issue 39, D3)."""

from __future__ import annotations

import pytest
from test_harness import config_error_line

from centroidkv import schema

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ D3. storage parameters' bounds, fast
@pytest.mark.parametrize(
    "spec, line",
    [
        (
            "snapkv(kv_precision=int4,kv_group=1073741824)",
            "snapkv: kv_group must be a power of two in [1, 256] (it divides the head size), got 1073741824",
        ),
        (
            "snapkv(kv_precision=int4,kv_residual=1000000000)",
            "snapkv: kv_residual must be an integer in [0, 131072] (tokens kept in full precision), "
            "got 1000000000",
        ),
        (
            "snapkv(kv_precision=int4,kv_group=3)",
            "snapkv: kv_group must be a power of two (it divides the head size), got 3",
        ),
    ],
)
def test_storage_parameters_are_bounded_in_the_torch_free_check(spec, line):
    """Before: a huge group or residual passed and every record failed allocating ~130 GB; kv_group=3
    was refused only once torch had loaded."""
    assert schema.method_spec_errors(spec, schema.build_schema()) == [line]


def test_run_refuses_a_huge_group_in_one_line(tmp_path):
    override = "methods=[{name:snapkv,params:{kv_precision:int4,kv_group:1073741824}}]"
    assert "kv_group must be a power of two in [1, 256]" in config_error_line(tmp_path, [override])
