"""Values down (issue 52): a head group runs on the plan it is handed and refers to nothing above it,
and the byte plan is a pure function of a frozen shape (`centroidkv.cache.group_plan`,
`centroidkv.cache.byte_plan`)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from centroidkv import CompressedCache, get_method
from centroidkv.cache.byte_plan import ByteShape, solve
from centroidkv.cache.group_plan import GroupPlan
from centroidkv.cache.head_group import HeadGroup
from centroidkv.cache.quantization import StorageFormat
from centroidkv.kv import LayerStats
from tests.test_core_cache import prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def plan(budget_len: int | None, **changes) -> GroupPlan:
    method = get_method("streaming_llm", n_sink=2, n_recent=2, compress_interval=4)
    settings = dict(
        storage=StorageFormat(),
        in_place=True,
        keeps_records=True,
        entry_records=(),
        window_records=(),
        budget_len=budget_len,
        compress_above=budget_len,
        compresses=budget_len is not None,
        compress_interval=4,
        max_new_tokens=0,
        window=None,
        method=method,
        n_sink=2,
        n_recent=2,
        merges=False,
        label="streaming_llm",
    )
    return GroupPlan(**{**settings, **changes})


def test_a_head_group_runs_on_the_plans_it_is_handed_without_a_cache():
    group = HeadGroup()
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    group.add(keys, values, 0, plan(None))
    assert group.length == 20 and group.dtype == torch.float32
    assert not group.needs_compression(plan(None))  # no budget: never compressed
    assert group.needs_compression(plan(8))
    group.compress(plan(8), LayerStats(0, 1, 1.0))
    assert group.length == 8 and group.protected_used == (2, 2)
    assert torch.equal(group.keys[:, :, :2], keys[:, :, :2]) and torch.equal(
        group.keys[:, :, -2:], keys[:, :, -2:]
    )
    assert group._buffers["keys"][0].shape[2] == 8 + 4  # room for the g tokens before the next compression
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan(8).budget_len = 9


def test_no_head_group_refers_to_its_layer_or_cache(tiny_model):
    cache = CompressedCache("h2o", 0.5, 4)
    tiny_model(prompt(120), past_key_values=cache)
    for layer in cache.layers:
        for group in layer.groups:
            held = list(vars(group).values())
            assert not any(
                isinstance(value, (CompressedCache, weakref.ref)) or value is layer for value in held
            )


def shape(**changes) -> ByteShape:
    settings = dict(
        batch=1,
        n_heads=2,
        head_dim=8,
        itemsize=4,
        n_records=0,
        storage=StorageFormat(),
        listed=(0, 0),
        listed_whole=False,
        heads_boost=2.0,
        windows=(None, None),
        n_seen=100,
        prompt_len=100,
        max_new_tokens=20,
        budget=0.25,
        query_group=1,
        window_records=0,
        layer_budget=lambda total, layer_idx, n_layers: total,
        method_name="plain",
    )
    return ByteShape(**{**settings, **changes})


def test_the_byte_plan_is_a_function_of_the_shape_alone():
    assert solve(shape()) == [30, 30]  # keys and values only: B = R * (n + Gamma), as in entries
    assert solve(shape(n_records=1))[0] < 30  # a record per entry is paid for with entries
    assert solve(shape(listed=(1, 0), listed_whole=True))[0] < 30  # so is a head kept whole
    with pytest.raises(ValueError, match="plain at budget 0.05 in bytes: .*heads kept whole"):
        solve(shape(budget=0.05, listed=(2, 2), listed_whole=True))
