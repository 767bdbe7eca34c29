"""`kv_capacity_bytes()` is every byte a cache's tensors keep allocated (issue 53, M2): walking every
tensor a fork's cache holds and summing the distinct storages behind them gives the same number, for
packed stores (int8/4/2 codes, their scales and zeros, the full-precision residual with its
headroom), a 16-bit store and the model's dtype; after compression, after a question and decoding,
and for a fork of a compressed cache (how several questions share one compression), whose views
keep its source's buffers, headroom included, alive. A tiny random model built here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from centroidkv import CompressedCache, get_method, load_model
from centroidkv.plan.decoding import decode_forks, needs_of, prefill, start_fork

pytestmark = pytest.mark.usefixtures("one_thread")

STORES = [("streaming_llm", "int4"), ("centroidkv", "int8"), ("kivi", "int2"), ("snapkv", "fp16"),
          ("streaming_llm", "model")]  # fmt: skip


def allocated_bytes(cache: CompressedCache) -> int:
    """The distinct storages behind every tensor reachable from `cache` (its layers, groups, buffers,
    codes and records), without following the model or another cache."""
    storages, seen, stack = {}, set(), [cache]
    while stack:
        item = stack.pop()
        if (
            id(item) in seen
            or isinstance(item, nn.Module)
            or (item is not cache and isinstance(item, CompressedCache))
        ):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return sum(storages.values())


@pytest.fixture(scope="module")
def source():
    model, _ = load_model("tiny-llama")
    methods = [get_method(name, kv_precision=precision) for name, precision in STORES]
    prompt = torch.randint(10, 500, (1, 600), generator=torch.Generator().manual_seed(0))
    return model, methods, prefill(model, prompt, 64, needs=needs_of(methods))


@pytest.mark.parametrize("index", range(len(STORES)), ids=[f"{m}@{p}" for m, p in STORES])
def test_a_forks_allocated_bytes_are_what_it_counts(source, index):
    model, methods, prefilled = source
    question = torch.randint(10, 500, (1, 20), generator=torch.Generator().manual_seed(1))
    fork = start_fork(model, prefilled, methods[index], 0.25, 64, question)
    assert allocated_bytes(fork.cache) == fork.cache.kv_capacity_bytes() > fork.cache.kv_bytes()
    decode_forks(model, [fork], 40, set())
    assert allocated_bytes(fork.cache) == fork.cache.kv_capacity_bytes()


@pytest.mark.parametrize("index", range(len(STORES)), ids=[f"{m}@{p}" for m, p in STORES])
def test_a_fork_of_a_compressed_cache_counts_the_buffers_its_views_keep(source, index):
    """Before: the fork's views of its source's buffers counted their live entries only (a packed
    store's residual and the model's dtype's decode headroom went uncounted)."""
    _, methods, prefilled = source
    compressed = prefilled.cache.fork(methods[index], 0.25, 64)
    question_fork = compressed.fork(methods[index], 0.25, 64)
    assert allocated_bytes(question_fork) == question_fork.kv_capacity_bytes()
    assert question_fork.kv_capacity_bytes() == compressed.kv_capacity_bytes()  # the same storages
