"""Every tensor a fork's cache holds is its own and counted (issue 29, M1 and M2).

For every native method and head policy on a tiny random model: the tensors reachable from a fork's
cache (entries, degrees, entry records, window records, whole heads, the favoured heads' layer, head
ids) add up to `kv_bytes()`; none shares storage with the shared prefill; the storages behind them
(buffers with headroom included) add up to `kv_capacity_bytes()`; and a byte budget still stores R.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from centroidkv import CompressedCache
from centroidkv.cache.cache import CompressedLayer
from centroidkv.cache.head_group import HeadGroup
from centroidkv.plan.decoding import decode_forks, needs_of, prefill, start_fork
from tests.test_head_policies import BUDGETS, NATIVE, NEW_TOKENS, UNDER, build, head_file, prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def reachable(obj: object, seen: set[int] | None = None, buffers: bool = False) -> list[Tensor]:
    """Every tensor held by a cache, its layers, their head groups, dicts and dataclasses (distinct
    objects); with `buffers`, also the in-place buffers behind the live views."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, CompressedCache):
        return [t for layer in obj.layers for t in reachable(layer, seen, buffers)]
    if isinstance(obj, (CompressedLayer, HeadGroup)):
        found = []
        for name, value in vars(obj).items():
            if name in ("_owner", "_layer") or (name == "_buffers" and not buffers):
                continue
            found += reachable(value, seen, buffers)
        return found
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in reachable(value, seen, buffers)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in reachable(value, seen, buffers)]
    if dataclasses.is_dataclass(obj):  # e.g. the packed codes of a quantized slot
        return [t for value in vars(obj).values() for t in reachable(value, seen, buffers)]
    return []


def storages(tensors: list[Tensor]) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage behind `tensors` (empty tensors have none)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}


def check_own_and_counted(cache: CompressedCache, source: CompressedCache) -> None:
    held = reachable(cache)
    assert sum(t.numel() * t.element_size() for t in held) == cache.kv_bytes()
    behind = storages(reachable(cache, buffers=True))
    assert not set(behind) & set(storages(reachable(source, buffers=True))), "shares the prefill's storage"
    assert sum(behind.values()) == cache.kv_capacity_bytes()


@pytest.mark.parametrize("policy", ["none", "whole", "budget"])
@pytest.mark.parametrize("name", NATIVE)
def test_a_fork_holds_only_its_own_counted_tensors(tiny_model, tmp_path, name, policy):
    if name == "duo_attention" and policy != "whole":
        pytest.skip("DuoAttention keeps its heads whole")
    method, budget = build(name, policy, head_file(tmp_path, tiny_model)), BUDGETS.get(name, 0.5)
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS, needs=needs_of([method]))
        cache = prefilled.cache.fork(method, budget, NEW_TOKENS)
        assert cache.n_compressions == 1
        check_own_and_counted(cache, prefilled.cache)
        assert -UNDER.get(name, 0.01) < (cache.budget_ratio() - budget) / budget < 0.01
        token = prefilled.first_token
        for _ in range(2 * method.compress_interval + 1):  # two re-compressions
            token = tiny_model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        assert cache.n_compressions >= 3
        check_own_and_counted(cache, prefilled.cache)


def test_snapkv_window_is_counted_in_the_byte_plan(tiny_model):
    """SnapKV's query window is stored by the fork, so its entries pay for it at a byte budget."""
    method = build("snapkv", "none", "")
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS, needs=needs_of([method]))
        cache = prefilled.cache.fork(method, 0.5, NEW_TOKENS)
        streaming = prefilled.cache.fork(build("streaming_llm", "none", ""), 0.5, NEW_TOKENS)
    windows = sum(w.numel() * w.element_size() for layer in cache.layers for w in layer.main.windows.values())
    assert windows > 0
    assert max(cache.seq_lengths()) < max(streaming.seq_lengths())
    assert cache.kv_bytes() == pytest.approx(streaming.kv_bytes(), rel=0.01)


def test_the_allocated_ratio_counts_the_decode_headroom(tiny_model):
    """M2: beside the live bytes (budget_ratio), a generation reports the bytes allocated right after
    compression (the buffers of B + g entries), over the same reference."""
    method = build("streaming_llm", "none", "")
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS)
        fork = start_fork(tiny_model, prefilled, method, 0.5, NEW_TOKENS)
        expected = fork.cache.kv_capacity_bytes() / fork.cache.reference_bytes()
        (generation,) = decode_forks(tiny_model, [fork], NEW_TOKENS, eos_token_ids=set())
    budget_len = fork.cache.group_plan(0).budget_len
    headroom = (budget_len + method.compress_interval) / budget_len
    assert generation.kv_allocated_ratio == pytest.approx(expected)
    assert generation.kv_allocated_ratio == pytest.approx(generation.kv_budget_ratio * headroom, rel=0.01)
