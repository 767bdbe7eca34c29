"""The head policy and the storage precision wrap any method (issue 52, item 2; `centroidkv.wrapper`):
no method has a field of either, a method that has never heard of them takes both, and what runs
record, check and show is what it was when they were fields of `Method` (the dicts below were written
by that code, before the change)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import baselines
import centroidkv
from centroidkv.cache.quantization import StorageFormat
from centroidkv.methods import (
    REGISTRY,
    HeadPolicy,
    LayerKV,
    LayerStats,
    Method,
    StoragePrecision,
    get_method,
    method_class,
    method_label,
    method_variant,
    param,
    register,
)
from centroidkv.plan.decoding import needs_of, prefill
from centroidkv.schema import method_errors
from centroidkv.wrapper import WRAPPERS, MethodWrapper, innermost, register_wrapper
from tests.test_head_policies import head_file

pytestmark = pytest.mark.usefixtures("one_thread")

WRAPPER_PARAMS = {
    "heads",
    "heads_file",
    "heads_fraction",
    "heads_boost",
    "kv_precision",
    "kv_group",
    "kv_residual",
}
SHARED = {"n_sink": 16, "n_recent": 64, "compress_interval": 64}
POLICY = {"heads": "none", "heads_file": "clustering", "heads_fraction": 0.04, "heads_boost": 4.0}
SNAP = {"window_size": 32, "kernel_size": 5, "pooling": "avgpool"}

# (name, parameters) -> (params() in its order, label, variant), as the code before the wrappers gave them
RECORDED = [
    (
        ("centroidkv", {}),
        {
            **SHARED,
            **POLICY,
            "heads": "whole",
            "chunk_size": 256,
            "schedule": "adaptive",
            "r_init": 0.5,
            "delta_r": 0.0,
            "r_min": 0.1,
            "similarity": "pre_rope",
        },
        "CentroidKV",
        "centroidkv",
    ),
    (
        ("snapkv", {"kv_precision": "int4", "heads": "whole"}),
        {
            "n_sink": 0,
            "n_recent": 32,
            "compress_interval": 64,
            **POLICY,
            "heads": "whole",
            "kv_precision": "int4",
            "kv_group": 32,
            "kv_residual": 128,
            **SNAP,
        },
        "SnapKV @int4",
        "snapkv-int4",
    ),
    (
        ("duo_attention", {}),
        {
            "n_sink": 4,
            "n_recent": 64,
            "compress_interval": 64,
            **POLICY,
            "heads": "whole",
            "heads_file": "streaming",
        },
        "DuoAttention",
        "duo_attention",
    ),
    (
        ("kivi", {}),
        {**SHARED, **POLICY, "kv_precision": "int2", "kv_group": 32, "kv_residual": 128},
        "KIVI @int2",
        "kivi-int2",
    ),
    (
        ("kvpress", {}),
        {**SHARED, **POLICY, "press": "SnapKVPress", "press_params": {}},
        "SnapKV (kvpress)",
        "kvpress-SnapKV",
    ),
    (
        ("h2o", {"kv_precision": "int8", "heads": "budget"}),
        {
            "n_sink": 0,
            "n_recent": 64,
            "compress_interval": 64,
            **POLICY,
            "heads": "budget",
            "kv_precision": "int8",
            "kv_group": 32,
            "kv_residual": 128,
            "recent_ratio": 0.5,
        },
        "H2O @int8",
        "h2o-int8",
    ),
    (("full", {}), {**SHARED, **POLICY}, "Full cache", "full"),
    (
        ("streaming_llm", {"kv_precision": "int2", "kv_group": 64, "kv_residual": 32}),
        {
            "n_sink": 4,
            "n_recent": 64,
            "compress_interval": 64,
            **POLICY,
            "kv_precision": "int2",
            "kv_group": 64,
            "kv_residual": 32,
        },
        "StreamingLLM @int2",
        "streaming_llm-int2",
    ),
    (
        ("pyramidkv", {"heads": "budget", "heads_boost": 2.5, "heads_fraction": 0.1}),
        {
            "n_sink": 0,
            "n_recent": 32,
            "compress_interval": 64,
            **POLICY,
            "heads": "budget",
            "heads_fraction": 0.1,
            "heads_boost": 2.5,
            **SNAP,
            "beta": 20.0,
        },
        "PyramidKV",
        "pyramidkv",
    ),
]

# (name, parameters) -> the one line get_method and the torch-free schema give, as before
REFUSED = [
    (
        ("duo_attention", {"heads": "none"}),
        "duo_attention: heads must be whole (the retrieval heads keep the full cache; other policies: "
        "streaming_llm), got 'none'",
    ),
    (
        ("kvpress", {"kv_precision": "int4", "heads": "whole"}),  # the first in the rules' order
        "kvpress: heads must be none (presses compress inside kvpress's own hooks, which apply no head "
        "policy; native methods take heads=whole|budget), got 'whole'",
    ),
    (
        ("kvpress", {"kv_precision": "int8"}),
        "kvpress: kv_precision must be model (kv_precision needs the harness's own cache; a press stores "
        "the model's dtype), got 'int8'",
    ),
    (
        ("kivi", {"kv_precision": "int8"}),
        "kivi: kv_precision must be one of int2, int4 (KIVI-2, KIVI-4; other precisions: method full "
        "with kv_precision), got 'int8'",
    ),
    (("snapkv", {"heads_boost": 1.0}), "snapkv: heads_boost must be a number > 1, got 1.0"),
    (
        ("snapkv", {"kv_group": 3}),
        "snapkv: kv_group must be a power of two (it divides the head size), got 3",
    ),
    (
        ("duo_attention", {"heads_fractio": 0.1}),
        "duo_attention: unknown parameter(s) heads_fractio; known: compress_interval, heads, heads_boost, "
        "heads_file, heads_fraction, kv_group, kv_precision, kv_residual, n_recent, n_sink; did you mean "
        "heads_fraction?",
    ),
]


def method_classes() -> list[type]:
    """Method and every subclass the library and the baselines define."""
    for package in (centroidkv, baselines):
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{package.__name__}."):
            if not info.name.rsplit(".", 1)[-1].startswith("_"):
                importlib.import_module(info.name)
    found, todo = [], [Method]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_no_method_has_a_field_of_a_wrapper():
    classes = method_classes()
    assert {method_class(name) for name in REGISTRY} <= set(classes)
    for cls in classes:
        assert not WRAPPER_PARAMS & {f.name for f in dataclasses.fields(cls)}, cls
    assert {name for wrapper in WRAPPERS for name in wrapper.parameter_names()} == WRAPPER_PARAMS


@pytest.mark.parametrize(("built", "params", "label", "variant"), RECORDED)
def test_records_labels_and_variants_are_those_of_the_fields(built, params, label, variant):
    name, given = built
    recorded = get_method(name, **given).params()
    assert list(recorded.items()) == list(params.items())  # the values and their order in a record
    assert method_label(name, recorded) == label and method_variant(name, recorded) == variant
    if not given:  # built with its defaults, or without get_method: as it runs (at the wrappers' defaults)
        assert method_class(name).default_params() == params
        assert list(method_class(name)().params().items()) == list(params.items())


@pytest.mark.parametrize(("built", "line"), REFUSED)
def test_refusals_are_the_lines_of_the_fields(built, line):
    from centroidkv.schema import build_schema

    name, given = built
    with pytest.raises(ValueError) as refused:
        get_method(name, **given)
    assert str(refused.value) == line
    ordered = {key: given[key] for key in method_class(name).rules() if key in given} | given
    assert method_errors(name, ordered, build_schema())[0] == line


def test_methods_set_the_wrappers_rules_apart():
    rules = method_class("duo_attention").rules()
    assert list(rules)[:7] == ["n_sink", "n_recent", "compress_interval", *POLICY]
    assert rules["heads"] == {
        "default": "whole",
        "type": "str",
        "choices": ["whole"],
        "reason": "the retrieval heads keep the full cache; other policies: streaming_llm",
    }
    assert rules["heads_file"] == {
        "default": "streaming",
        "type": "str",
        "reason": "needle or streaming or clustering or a path",
    }
    assert method_class("centroidkv").rules()["heads"]["choices"] == ["none", "whole", "budget"]
    assert method_class("kivi").rules()["kv_precision"]["choices"] == ["int2", "int4"]
    assert method_class("kvpress").rules()["heads"]["choices"] == ["none"]
    # a bare method (not built by get_method) reads as at its wrappers' defaults
    bare = method_class("centroidkv")()
    assert HeadPolicy.of(bare).heads == "whole" and HeadPolicy.of(bare).method is bare
    assert StoragePrecision.of(method_class("kivi")()).storage == StorageFormat("int2")


@dataclass
class KeepLast(Method):
    """Keep the most recent entries: a method that has never heard of heads or precisions."""

    name = "keep_last_wrapped"

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        index = torch.arange(kv.length - target_len, kv.length, device=kv.keys.device)
        return kv.select(index.expand(*kv.keys.shape[:2], -1))


@pytest.fixture
def keep_last():
    register(KeepLast)
    try:
        yield KeepLast.name
    finally:
        REGISTRY.pop(KeepLast.name, None)


def test_a_policy_keeps_the_listed_heads_of_any_method_whole(tiny_model, tmp_path, keep_last):
    path = head_file(tmp_path, tiny_model)  # layer 0's KV head 1 listed at a fraction of 0.25
    method = get_method(keep_last, heads="whole", heads_file=path, heads_fraction=0.25, n_sink=4, n_recent=16)
    assert isinstance(method, HeadPolicy) and isinstance(innermost(method), KeepLast)
    assert method.name == keep_last and method.compresses  # what a wrapper does not hold is the method's
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefilled = prefill(tiny_model, ids, 8, needs=needs_of([method]))
        cache = prefilled.cache.fork(method, 0.25, 8)
    whole = cache.layers[0].group("whole")
    assert whole.heads.tolist() == [1] and torch.equal(whole.keys, prefilled.cache.layers[0].keys[:, [1]])
    assert cache.layers[0].main.length < 200 and cache.layers[1].group("whole") is None


def test_a_precision_stores_the_entries_of_any_method_in_int4(tiny_model, keep_last):
    ids = torch.randint(3, 500, (1, 300), generator=torch.Generator().manual_seed(1))
    small = {"n_sink": 4, "n_recent": 16, "kv_group": 16, "kv_residual": 16}
    four, own = (
        get_method(keep_last, kv_precision="int4", **small),
        get_method(keep_last, n_sink=4, n_recent=16),
    )
    assert StoragePrecision.of(four).storage == StorageFormat("int4", 16, 16)
    with torch.inference_mode():
        prefilled = prefill(tiny_model, ids, 8)
        coded, plain = (prefilled.cache.fork(m, 0.5, 8, budget_unit="entries") for m in (four, own))
    assert all(set(layer.main.packed) == {"keys", "values"} for layer in coded.layers)
    assert coded.seq_lengths() == plain.seq_lengths() and coded.kv_bytes() < 0.5 * plain.kv_bytes()


@dataclass
class Tagged(MethodWrapper):
    """A new wrapper in one file, touching no method: a tag every run records when it has one."""

    depth = 30

    tag: str = param("", reason="any text")

    @classmethod
    def recorded(cls, values: dict[str, Any]) -> dict[str, Any]:
        return values if values["tag"] else {}


def test_a_new_wrapper_is_one_class_that_touches_no_method():
    register_wrapper(Tagged)  # what its module's `@register_wrapper` does when it is imported
    try:
        method = get_method("snapkv", tag="run-1", heads="whole")
        assert isinstance(method, Tagged) and HeadPolicy.of(method).heads == "whole"
        assert list(method.params())[3:5] == ["tag", "heads"]  # after the shared ones, outermost first
        assert "tag" not in get_method("snapkv").params()  # untagged runs keep their identity
        assert method_class("snapkv").rules()["tag"] == {"default": "", "type": "str", "reason": "any text"}
        with pytest.raises(ValueError, match="snapkv: tag must be a string"):
            get_method("snapkv", tag=3)
    finally:
        WRAPPERS.remove(Tagged)
    assert "tag" not in method_class("snapkv").rules()
