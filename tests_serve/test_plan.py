"""The compression schedule both sides follow (`centroidkv_vllm.plan`), against a step-by-step
simulation of the harness's rule (`CompressedLayer.needs_compression`): compress to B once the prompt
is in when n > B, then whenever the request holds B + g entries."""

from __future__ import annotations

import pytest

from centroidkv_vllm.plan import Plan


def simulate(anchor: int, budget: int, interval: int, steps: int) -> list[tuple[int, int, bool]]:
    """(computed, kept start, compressed at this step) for each decode step from the anchor."""
    start, rows = 0, []
    for computed in range(anchor, anchor + steps):
        held = computed - start
        limit = budget if computed == anchor else budget + interval - 1
        due = held > limit and budget >= 1
        if due:
            start = computed - budget
        rows.append((computed, start, due))
    return rows


@pytest.mark.parametrize(
    "anchor, budget, interval",
    [(1000, 266, 32), (1015, 523, 64), (11, 37, 32), (300, 300, 16), (301, 300, 1), (2048, 64, 64)],
)
def test_plan_matches_the_step_by_step_rule(anchor, budget, interval):
    plan = Plan(anchor, budget, interval)
    for computed, start, due in simulate(anchor, budget, interval, 700):
        assert plan.start(computed) == start, computed
        assert plan.due(computed) == due, computed


def test_kept_length_stays_between_b_and_b_plus_g_after_the_first_compression():
    plan = Plan.at(2048, 0.25, 512, 64)
    assert plan.budget == 640
    for computed in range(2048, 2048 + 512):
        assert plan.budget <= computed - plan.start(computed) < plan.budget + 64


def test_nothing_is_dropped_during_prefill():
    plan = Plan(1000, 266, 32)
    assert plan.start(0) == plan.start(999) == 0 and not plan.due(999)


def simulate_bytes(anchor: int, budget_at, interval: int, steps: int) -> list[tuple[int, int, bool]]:
    """The harness's rule with B in bytes (`CompressedCache.plan_budget`): B is solved once when the
    prompt is in and again at every compression for the tokens seen then; between compressions the
    last solved B holds, and the cache is compressed once it holds more than it (prefill) or B + g - 1."""
    start, budget, rows = 0, budget_at(anchor), []
    for computed in range(anchor, anchor + steps):
        held = computed - start
        limit = budget if computed == anchor else budget + interval - 1
        due = held > limit and budget >= 1
        if due:
            budget = budget_at(computed)
            start = computed - budget
        rows.append((computed, start, due))
    return rows


@pytest.mark.parametrize("anchor, interval", [(1000, 16), (723, 64), (150, 32), (40, 8)])
def test_plan_with_a_budget_solved_per_compression_matches_the_harness_rule(anchor, interval):
    """Heads kept whole grow with the tokens seen, so B falls as a request decodes (here by one entry
    every 40 tokens, from 200 at length 1000)."""

    def budget_at(seen: int) -> int:
        return max(1, 200 - (seen - 1000) // 40) if seen >= 1000 else 200 * seen // 1000

    plan = Plan.at(anchor, 0.25, 512, interval, budget_at)
    for computed, start, due in simulate_bytes(anchor, budget_at, interval, 600):
        assert plan.start(computed) == start, computed
        assert plan.due(computed) == due, computed
