"""Head policies for every native method (`centroidkv.head_policy`): heads=whole and heads=budget through a
prefill, re-compressions and batched forks, at the budget's bytes; DuoAttention's streaming heads."""

import json

import pytest
import torch

from centroidkv import get_method
from centroidkv.methods import method_class, method_names
from centroidkv.plan.decoding import decode_forks, needs_of, prefill, start_fork
from centroidkv.plan.prefill_compressor import compresses_in_prefill

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LEN, NEW_TOKENS = 300, 40
# PyramidKV at 0.5 on a 2-layer model gives layer 0 more than the prompt and stores less than R with
# or without a head policy (its known under-spend, docs/results.md): it is checked at 0.35.
BUDGETS = {"pyramidkv": 0.35}
# How far under R a method may land: PyramidKV's integer layer budgets on 2 layers move the stored
# bytes in steps of about 1 % of R (1.02 % under at 0.35 with its query window paid for).
UNDER = {"pyramidkv": 0.03}
SMALL = {"n_sink": 4, "n_recent": 16, "compress_interval": 8}
NATIVE = [
    name
    for name in method_names()
    if method_class(name).compresses and not compresses_in_prefill(method_class(name))
]


def head_file(tmp_path, model, worst=(0, 1)) -> str:
    """A head file whose single worst (layer, KV head) pair is `worst` (listed with heads_fraction 0.25)."""
    config = model.config
    errors = [[0.0] * config.num_key_value_heads for _ in range(config.num_hidden_layers)]
    errors[worst[0]][worst[1]] = 1.0
    data = {
        "model": model.centroidkv_name,
        "budget": 0.25,
        "fraction": 0.25,
        "n_layers": config.num_hidden_layers,
        "n_kv_heads": config.num_key_value_heads,
        "errors": errors,
        "outliers": [list(worst)],
    }
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(data))
    return str(path)


def build(name: str, policy: str, path: str):
    params = dict(SMALL, heads=policy, heads_file=path, heads_fraction=0.25, heads_boost=2.0)
    if name in ("snapkv", "pyramidkv"):
        params["window_size"] = 8
    if name == "centroidkv":
        params["chunk_size"] = 32
    return get_method(name, **params)


def prompt(length=PROMPT_LEN, seed=0):
    return torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", ["whole", "budget"])
@pytest.mark.parametrize("name", NATIVE)
def test_every_native_method_runs_each_policy_at_the_budget_s_bytes(tiny_model, tmp_path, name, policy):
    if name == "duo_attention" and policy != "whole":
        pytest.skip("DuoAttention is StreamingLLM with heads=whole by definition")
    method = build(name, policy, head_file(tmp_path, tiny_model))
    budget = BUDGETS.get(name, 0.5)
    plain = build(name, "none", head_file(tmp_path, tiny_model)) if name != "duo_attention" else None
    runs = [method] + ([plain] if plain else [])
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS, needs=needs_of(runs))
        forks = [start_fork(tiny_model, prefilled, run, budget, NEW_TOKENS) for run in runs]
        cache = forks[0].cache
        # R of the reference, in bytes
        assert -UNDER.get(name, 0.01) < (forks[0].measured["kv_budget_ratio"] - budget) / budget < 0.01
        layer = cache.layers[0]
        listed = layer.group("whole" if policy == "whole" else "favoured")
        assert listed.heads.tolist() == [1] and layer.main.heads.tolist() == [0]
        if policy == "budget":  # the favoured head is compressed too, to more entries than the other
            assert layer.main.length < listed.length < PROMPT_LEN
        else:
            assert torch.equal(listed.keys, prefilled.cache.layers[0].keys[:, [1]])
            assert torch.equal(listed.values, prefilled.cache.layers[0].values[:, [1]])
        decode_forks(tiny_model, forks, NEW_TOKENS, eos_token_ids=set())  # batched when two forks
    assert layer.main.n_compressions > 1  # re-compressed while decoding
    seen = PROMPT_LEN + NEW_TOKENS - 1
    assert layer.n_seen == seen
    if policy == "whole":  # every token seen, never compressed
        assert listed.keys.shape[2] == seen
    else:
        assert (
            listed.length
            <= cache.group_plan(layer.layer_idx, listed.role).budget_len + method.compress_interval - 1
        )
        assert listed.n_compressions >= 1
    # every stored tensor is counted, and what decoding adds stays within the g-token slack per head
    heads = len(layer.head_lengths())
    slack = cache.n_layers * heads * method.compress_interval * 2 * layer.keys.shape[-1] * 4 * 2
    assert cache.kv_bytes() <= budget * cache.reference_bytes() + slack
    if policy == "whole" and plain is not None:  # the plain run shares the prefill and is unaffected
        assert not forks[1].cache.layers[0].is_split()


def test_duo_attention_keeps_sinks_and_recent_on_streaming_heads(tiny_model, tmp_path):
    method = get_method(
        "duo_attention", heads_file=head_file(tmp_path, tiny_model), heads_fraction=0.25, **SMALL
    )
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS, needs=method.needs())
        cache = start_fork(tiny_model, prefilled, method, 0.5, NEW_TOKENS).cache
    for index, layer in enumerate(cache.layers):
        full = prefilled.cache.layers[index]
        budget = layer.main.length
        if not layer.is_split():  # no head listed here: every head streams
            streaming = list(range(full.keys.shape[1]))
        else:
            streaming, whole = layer.main.heads.tolist(), layer.group("whole")
            assert torch.equal(whole.keys, full.keys[:, whole.heads])  # the retrieval head, whole
        kept = torch.cat(
            [torch.arange(SMALL["n_sink"]), torch.arange(PROMPT_LEN - (budget - SMALL["n_sink"]), PROMPT_LEN)]
        )
        assert budget < PROMPT_LEN
        assert torch.equal(layer.keys, full.keys[:, streaming][:, :, kept])
    assert cache.layers[0].group("whole").heads.tolist() == [1]


def test_a_head_policy_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="heads must be one of"):
        get_method("snapkv", heads="some")
    with pytest.raises(ValueError, match="needs a method that compresses"):
        get_method("full", heads="whole")
    with pytest.raises(ValueError, match="heads_boost must be a number > 1"):
        get_method("h2o", heads="budget", heads_boost=1.0)
    with pytest.raises(ValueError, match="duo_attention: heads must be whole"):
        get_method("duo_attention", heads="budget")
    with pytest.raises(ValueError, match="does not exist"):
        get_method("streaming_llm", heads="whole", heads_file="/nonexistent/heads.json")


def test_the_needle_score_is_attention_mass_on_the_needle_positions(tiny_model):
    """All positions take every query's whole attention (mass 1); disjoint sets add up."""
    from centroidkv.head_scores import needle_mass

    ids = [prompt(120, seed=3)]
    everything = needle_mass(tiny_model, ids, [torch.arange(120)], n_queries=8)
    torch.testing.assert_close(everything, torch.ones_like(everything))
    first, rest = (
        needle_mass(tiny_model, ids, [torch.arange(40)], 8),
        needle_mass(tiny_model, ids, [torch.arange(40, 90)], 8),
    )
    both = needle_mass(tiny_model, ids, [torch.arange(90)], 8)
    torch.testing.assert_close(first + rest, both)
    assert (first > 0).all() and (both < 1).all()


def test_the_streaming_score_keeps_the_sinks_and_the_newest_entries():
    from centroidkv.calibrate import STREAMING_SINKS
    from centroidkv.head_scores import streaming_window

    keys = torch.arange(100.0).view(1, 1, 100, 1).expand(1, 2, 100, 3)
    kept, _ = streaming_window(keys, keys, 0.2)
    expected = [*range(STREAMING_SINKS), *range(100 - (20 - STREAMING_SINKS), 100)]
    assert kept[0, 0, :, 0].tolist() == expected and kept[0, 1, :, 0].tolist() == expected


@pytest.mark.parametrize("policy", ["whole", "budget"])
@pytest.mark.parametrize("name", ["h2o", "centroidkv", "snapkv"])
def test_a_layer_whose_every_head_is_listed_still_decodes(tiny_model, tmp_path, name, policy):
    """Before: when a policy listed every KV head of a layer (Qwen2.5-0.5B's calibration lists both
    heads of its layer 16), the layer's compressed group was empty and H2O's attention record failed
    every record ("the attention function must pass `received`")."""
    config = tiny_model.config
    errors = [[0.0] * config.num_key_value_heads for _ in range(config.num_hidden_layers)]
    errors[0] = [1.0] * config.num_key_value_heads  # every head of layer 0
    path = tmp_path / "all_heads.json"
    path.write_text(
        json.dumps(
            {
                "model": tiny_model.centroidkv_name,
                "budget": 0.25,
                "fraction": 0.5,
                "n_layers": config.num_hidden_layers,
                "n_kv_heads": config.num_key_value_heads,
                "errors": errors,
                "outliers": [[0, head] for head in range(config.num_key_value_heads)],
            }
        )
    )
    method = build(name, policy, str(path))
    method = get_method(name, **{**method.params(), "heads_fraction": 0.5})
    with torch.inference_mode():
        prefilled = prefill(tiny_model, prompt(), NEW_TOKENS, needs=needs_of([method]))
        fork = start_fork(tiny_model, prefilled, method, 0.75, NEW_TOKENS)  # half the heads whole
        decode_forks(tiny_model, [fork], NEW_TOKENS, eos_token_ids=set())
    layer = fork.cache.layers[0]
    assert layer.keys.shape[1] == 0 and layer.n_seen == PROMPT_LEN + NEW_TOKENS - 1
    assert fork.cache.layers[1].main.n_compressions >= 1
