"""Records say what a packed store holds and when it kept every token (issue 39, M1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ M1. what a packed store really holds
def test_records_say_what_a_packed_store_holds_and_when_it_kept_every_token(tiny_model):
    """Before: an int4 cache at R = 0.9 kept every token and stored well under R, and no field said
    so; kv_budget_ratio (right after compression) was the only ratio recorded."""
    from centroidkv import get_method
    from centroidkv.plan.plan import CONTEXT_ONLY, Prompt, Run
    from centroidkv.plan.plan import run as plan_run

    ids = torch.randint(10, tiny_model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    context, question = ids[:195].tolist(), ids[195:].tolist()
    int4 = dict(kv_precision="int4", kv_group=16, kv_residual=16, compress_interval=8)
    runs = [
        Run(get_method("snapkv", **int4), 0.9),  # more than 4-bit codes can spend: nothing evicted
        Run(get_method("snapkv", compress_interval=8), 0.4),
        Run(get_method("full"), 1.0),
    ]
    outcomes = plan_run(
        tiny_model, Prompt(context, question, context, question, CONTEXT_ONLY), runs, 12, set()
    )
    packed, plain, full = (outcome.generation.measured for outcome in outcomes)
    assert packed["kept_every_token"] is True and packed["kv_final_ratio"] < 0.9 * 0.5
    assert plain["kept_every_token"] is False
    assert plain["kv_final_ratio"] == pytest.approx(plain["kv_budget_ratio"], rel=0.2)
    assert full["kept_every_token"] is None
