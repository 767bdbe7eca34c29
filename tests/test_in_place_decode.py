"""In-place decoding: preallocated buffers give the same tokens and byte counts as concatenation,
write without reallocating between compressions, and never disturb a view another cache holds."""

import json

import pytest
import torch

from centroidkv import CompressedCache, get_method

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LEN, STEPS, BUDGET = 300, 40, 0.3
UNIT = "entries"  # the outlier file keeps half of a tiny model's heads whole: more than R in bytes


def prompt(length=PROMPT_LEN, seed=0):
    return torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(seed))


def outlier_file(tmp_path, model) -> str:
    """Layer 0 keeps KV head 1 whole, layer 1 head 0 (with heads_fraction 0.5)."""
    config = model.config
    path = tmp_path / "heads.json"
    data = {
        "model": model.centroidkv_name,
        "budget": 0.25,
        "fraction": 0.5,
        "n_layers": config.num_hidden_layers,
        "n_kv_heads": config.num_key_value_heads,
        "errors": [[0.0, 1.0], [1.0, 0.0]],
        "outliers": [],
    }
    path.write_text(json.dumps(data))
    return str(path)


def build(name: str, model, tmp_path):
    small = {"n_sink": 4, "n_recent": 16, "compress_interval": 8}
    if name == "centroidkv":  # every part of the layout: whole heads, degrees, position records
        return get_method(
            name, chunk_size=32, heads_file=outlier_file(tmp_path, model), heads_fraction=0.5, **small
        )
    if name == "full":
        return get_method(name)
    if name == "snapkv":
        return get_method(name, window_size=8, **small)
    return get_method(name, **small)


def decode(model, cache, question, steps):
    """Feed the question with compression paused, then greedy-decode; per-step tokens and bytes."""
    with cache.paused():
        logits = model(question, past_key_values=cache).logits[:, -1]
    tokens, live, capacity, storages, compressions = [], [], [], [], []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token.item())
        logits = model(token, past_key_values=cache).logits[:, -1]
        live.append(cache.kv_bytes())
        capacity.append(cache.kv_capacity_bytes())
        storages.append(cache.layers[0].keys.untyped_storage().data_ptr())
        compressions.append(cache.layers[0].main.n_compressions)
    return tokens, live, capacity, storages, compressions


@pytest.mark.parametrize("name", ["full", "centroidkv", "h2o", "snapkv", "streaming_llm"])
def test_in_place_decode_gives_the_tokens_and_bytes_of_concatenation(tiny_model, tmp_path, name):
    method = build(name, tiny_model, tmp_path)
    recorder = CompressedCache("full", 1.0, STEPS, needs=method.needs(), budget_unit=UNIT)
    with torch.inference_mode():
        tiny_model(prompt(), past_key_values=recorder)
        runs = {}
        for in_place in (False, True):
            recorder.in_place = in_place
            cache = recorder.fork(method, BUDGET)
            runs[in_place] = decode(tiny_model, cache, prompt(6, seed=1), STEPS)
    (tokens, live, capacity, _, compressions), (tokens_ip, live_ip, capacity_ip, _, _) = (
        runs[False],
        runs[True],
    )
    assert tokens_ip == tokens
    assert live_ip == live  # kv_bytes counts live entries only, whatever the buffers hold
    assert capacity == live  # concatenation allocates exactly what it stores
    assert all(c >= b for c, b in zip(capacity_ip, live_ip))
    assert max(c - b for c, b in zip(capacity_ip, live_ip)) > 0  # the buffers do have headroom
    if name != "full":
        assert compressions[-1] >= 3  # decoding crossed several re-compressions


@pytest.mark.parametrize("name", ["full", "centroidkv"])
def test_decode_steps_write_into_one_buffer_between_compressions(tiny_model, tmp_path, name):
    method = build(name, tiny_model, tmp_path)
    # decode() feeds all STEPS tokens it generates: a generation of STEPS + 1 tokens
    recorder = CompressedCache("full", 1.0, STEPS + 1, needs=method.needs(), budget_unit=UNIT)
    with torch.inference_mode():
        tiny_model(prompt(), past_key_values=recorder)
        cache = recorder.fork(method, BUDGET)
        _, _, capacity, storages, compressions = decode(tiny_model, cache, prompt(6, seed=1), STEPS)

    # a step moves to a new buffer exactly when a compression made one (never, for the full cache)
    def changes(values):
        return [i for i in range(1, len(values)) if values[i] != values[i - 1]]

    assert changes(storages) == changes(compressions)
    assert len(changes(compressions)) >= (3 if name != "full" else 0)
    layer = cache.layers[0]
    if name == "full":  # the fork's first buffer: the prompt and question + the planned generation
        assert layer.main._buffers["keys"][0].shape[2] == PROMPT_LEN + 6 + STEPS
    else:  # a compression's buffer holds B + g entries
        budget_len = cache.group_plan(0).budget_len
        assert layer.main._buffers["keys"][0].shape[2] == budget_len + method.compress_interval
        assert layer.main._buffers["log_degree"][0].shape[2] == budget_len + method.compress_interval


def test_forks_never_see_each_others_tokens(tiny_model):
    """Two forks of one prefill, stepped alternately, and a fork of a fork taken mid-decoding, give
    what each gives alone; the source's tensors are unchanged."""
    with torch.inference_mode():
        recorder = CompressedCache("full", 1.0, STEPS)
        tiny_model(prompt(), past_key_values=recorder)
        source_keys = recorder.layers[0].keys.clone()
        feeds = {"a": torch.tensor([[11]]), "b": torch.tensor([[12]])}

        def run_alone(feed_ids, steps):
            cache = recorder.fork("full", 1.0)
            return [tiny_model(feed_ids, past_key_values=cache).logits[:, -1] for _ in range(steps)]

        alone = {key: run_alone(ids, 6) for key, ids in feeds.items()}
        forks = {key: recorder.fork("full", 1.0) for key in feeds}
        interleaved = {key: [] for key in feeds}
        for _ in range(6):
            for key, cache in forks.items():
                interleaved[key].append(tiny_model(feeds[key], past_key_values=cache).logits[:, -1])
        for key in feeds:
            torch.testing.assert_close(torch.cat(interleaved[key]), torch.cat(alone[key]), atol=1e-5, rtol=0)
        # a fork of fork "a" (which owns a buffer now), then both go on with different tokens
        child = forks["a"].fork("full", 1.0)
        child_keys = child.layers[0].keys.clone()
        for _ in range(3):
            tiny_model(feeds["b"], past_key_values=forks["a"])
        assert torch.equal(child.layers[0].keys, child_keys)
        assert torch.equal(recorder.layers[0].keys, source_keys)
