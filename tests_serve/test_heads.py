"""Heads kept whole (`centroidkv_vllm.heads`): the listed heads of the embedded model, and the
scheduler's count of a request's side store in pool blocks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from centroidkv_vllm.__main__ import DEFAULT_MODEL  # noqa: E402
from centroidkv_vllm.config import CentroidConfig  # noqa: E402
from centroidkv_vllm.heads import HeadLayout, listed_heads  # noqa: E402
from centroidkv_vllm.plan import Plan  # noqa: E402
from centroidkv_vllm.scheduler import CentroidManager, CentroidSpec  # noqa: E402

BLOCK, LAYERS, KV_HEADS, DIM = 128, 30, 3, 64
CONFIG = CentroidConfig(budget=0.25, max_new_tokens=128, heads="whole")


def layout(itemsize: int = 4) -> HeadLayout:
    listed = listed_heads(CONFIG, str(DEFAULT_MODEL), LAYERS, KV_HEADS)
    return HeadLayout(tuple(tuple(listed.get(i, ())) for i in range(LAYERS)), KV_HEADS, DIM, itemsize, 3)


def test_the_embedded_models_calibrated_heads_are_listed_and_b_pays_for_them():
    """The packaged head file's worst 4 % (4 of 90 pairs); B in bytes is below B in entries, and falls
    as the heads kept whole grow."""
    heads = layout()
    assert heads.listed[7] == (2,) and heads.listed[17] == (1,) and heads.listed[18] == (2,)
    assert heads.listed[23] == (0,) and heads.n_listed == 4
    budget = heads.budget_at(CONFIG, 1024)
    assert budget(1024) < Plan.at(1024, 0.25, 128, 64).budget == 288
    assert budget(1024) >= budget(1088) >= budget(1152)
    assert heads.side_bytes(1152) == 1152 * 4 * 2 * DIM * 4


def test_the_scheduler_keeps_the_side_stores_blocks_of_those_it_frees():
    """At a request's first compression its blocks before the kept start go back to the pool, except
    as many as its side store takes at n + Gamma tokens (one block id's bytes over all layers)."""
    heads = layout()
    spec = CentroidSpec(
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_size=DIM,
        dtype=torch.float32,
        centroid=CONFIG,
        layout=heads,
        block_bytes=BLOCK * KV_HEADS * 2 * DIM * 4 * LAYERS,
    )
    pool = BlockPool(num_gpu_blocks=40, enable_caching=False, hash_block_size=BLOCK)
    manager = CentroidManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=BLOCK
    )
    manager.allocate_new_blocks("r", 1025, 1025)  # the prompt and the first decoded token's slot
    assert len(manager.req_to_blocks["r"]) == 9
    manager.remove_skipped_blocks("r", 1024, 1024)  # the anchor: compressed to B
    plan = manager.plans["r"]
    reserve = heads.reserved_blocks(1024 + 128, spec.block_bytes)
    assert reserve == 1 and plan.budget == heads.budget_at(CONFIG, 1024)(1024)
    held = [block for block in manager.req_to_blocks["r"] if not block.is_null]
    assert len(held) == 9 - plan.start(1024) // BLOCK + reserve
    manager.pop_blocks_for_free("r")
    assert "r" not in manager.plans
