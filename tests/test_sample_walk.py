"""scripts/sample_walk.py counts a reader's walk: stays, returns to a room already left, and calls that
climb against the import picture; and it follows a real sample through the evaluator."""

from __future__ import annotations

from scripts.sample_walk import first_calls, paths_only, walk

GRAPH = {
    "eval.runner": {"centroidkv.plan.plan"},
    "centroidkv.plan.plan": {"centroidkv.kv"},
    "centroidkv.kv": set(),
}


def call(caller: str, callee: str, name: str, caller_line: int = 1, callee_line: int = 2):
    return (caller, (caller, caller_line), callee, (callee, callee_line), name)


def test_a_return_to_a_caller_counts_and_a_callback_climbs():
    calls = [
        call("eval/runner.py", "centroidkv/plan/plan.py", "run"),
        call("centroidkv/plan/plan.py", "centroidkv/kv.py", "gather", 2, 3),
        call("centroidkv/plan/plan.py", "eval/runner.py", "keep", 2, 4),  # a callback: runner imports plan
    ]
    found = walk(calls, GRAPH)
    assert found["stays"] == [
        "eval/runner.py", "centroidkv/plan/plan.py", "centroidkv/kv.py", "centroidkv/plan/plan.py", "eval/runner.py"
    ]  # fmt: skip
    assert found["returns"] == 2
    assert found["climbs"] == ["centroidkv/plan/plan.py -> eval/runner.py (keep)"]


def test_the_path_leaves_out_helpers_that_call_nothing_outside_their_file():
    calls = [
        call("eval/runner.py", "centroidkv/plan/plan.py", "run"),  # plan's run calls into kv.py: on the path
        call("centroidkv/plan/plan.py", "centroidkv/kv.py", "gather", 2, 3),  # gather calls nothing further
    ]
    assert [c[4] for c in paths_only(calls)] == ["run"]


def test_a_real_sample_walks_from_the_evaluator_through_the_plan_into_the_method():
    from scripts.sample_walk import one_sample
    from tests.test_import_cycles import ROOT, import_graph

    action = one_sample(["full", "snapkv"], 0.5)
    records = []
    calls = first_calls(lambda: records.extend(action()))
    assert [r["status"] for r in records] == ["ok", "ok"]
    stays = walk(calls, import_graph(ROOT))["stays"]
    assert stays[0] == "eval/evaluate.py" and {"centroidkv/plan/plan.py", "baselines/snapkv.py"} <= set(stays)
    assert all(room.split("/")[0] in ("centroidkv", "eval", "baselines") for room in stays)
