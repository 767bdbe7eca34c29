"""What a failure costs in one plan (`centroidkv.plan.plan.run`): a fork that fails to start is final at
once and the others decode; a batch that fails is decoded again fork by fork, each from its own
source, so only the fork that fails alone keeps an error. Every outcome is final exactly once, and
`on_outcome` hears of it as soon as it is."""

from __future__ import annotations

import pytest
import torch

import centroidkv.plan.plan
from centroidkv import get_method
from centroidkv.plan.plan import Prompt, Run, run

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 6


def prompt_of(model) -> Prompt:
    ids = torch.randint(10, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    return Prompt(ids.tolist(), [], [], [])


def runs_of(*named: tuple[str, float]) -> list[Run]:
    return [Run.at(get_method(name), budget) for name, budget in named]


def test_a_fork_that_fails_to_start_is_final_first_and_the_others_decode_together(tiny_model):
    runs = runs_of(("full", 1.0), ("centroidkv", 0.001), ("snapkv", 0.5))  # 0.001: no room for a token
    heard: list[int] = []
    outcomes = run(
        tiny_model, prompt_of(tiny_model), runs, NEW_TOKENS, set(), on_outcome=lambda k, _: heard.append(k)
    )
    assert heard == [1, 0, 2]
    assert "no room for any token" in str(outcomes[1].error) and outcomes[1].generation is None
    assert [outcomes[k].fields["decode_batch"] for k in (0, 2)] == [2, 2]
    assert all(outcomes[k].error is None and len(outcomes[k].answer_ids) == NEW_TOKENS for k in (0, 2))


def test_a_failed_batch_is_decoded_fork_by_fork_and_only_the_failing_fork_keeps_an_error(
    tiny_model, monkeypatch
):
    runs = runs_of(("full", 1.0), ("centroidkv", 0.5), ("h2o", 0.5), ("snapkv", 0.5))
    prompt = prompt_of(tiny_model)
    alone = run(tiny_model, prompt, runs, NEW_TOKENS, set(), decode_batch=1)
    real_decode = centroidkv.plan.plan.decode_forks

    def fails_in_a_batch_and_for_h2o(model, forks, *args):
        if len(forks) > 1:
            raise RuntimeError("the batch fails")
        if forks[0].cache.method.name == "h2o":
            raise RuntimeError("h2o fails alone")
        return real_decode(model, forks, *args)

    monkeypatch.setattr(centroidkv.plan.plan, "decode_forks", fails_in_a_batch_and_for_h2o)
    heard: list[int] = []
    outcomes = run(tiny_model, prompt, runs, NEW_TOKENS, set(), on_outcome=lambda k, _: heard.append(k))
    assert heard == [0, 1, 2, 3]
    assert str(outcomes[2].error) == "h2o fails alone" and outcomes[2].generation is None
    for k in (0, 1, 3):
        assert outcomes[k].error is None and outcomes[k].fields == {"prefill_shared": True, "decode_batch": 1}
        assert outcomes[k].answer_ids == alone[k].answer_ids
