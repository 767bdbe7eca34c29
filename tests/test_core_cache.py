"""The compressed cache and the degree-aware attention on tiny random Llama and Mistral models."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from centroidkv import CompressedCache, get_method
from centroidkv.attention import degree_attention
from centroidkv.needs import ATTENTION_SUM


def stock_twin(model):
    """The same weights with transformers' own SDPA attention and no hooks: the reference."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    twin = type(model)(config)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def prompt(length=300, batch=1, seed=0):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, steps):
    """Plain-forward greedy decoding; returns tokens and per-step logits."""
    out = model(ids, past_key_values=cache)
    tokens, logits = [], [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        logits.append(model(token, past_key_values=cache).logits[:, -1])
    return torch.cat(tokens, dim=1), logits


def test_budget_one_equals_stock_generate(tiny_model):
    ids = prompt()
    reference = stock_twin(tiny_model).generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        past_key_values=DynamicCache(),
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    cache = CompressedCache(get_method("centroidkv"), budget=1.0, max_new_tokens=30)
    ours = tiny_model.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        past_key_values=cache,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert torch.equal(ours.sequences, reference.sequences)
    for a, b in zip(ours.logits, reference.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert cache.n_compressions == 0


def test_compression_shrinks_tensors_and_keeps_invariants(tiny_model):
    ids, steps, budget = prompt(400), 200, 0.3
    method = get_method("centroidkv", chunk_size=32)
    recorder = CompressedCache("full", budget=1.0, max_new_tokens=steps, budget_unit="entries")
    tiny_model(ids, past_key_values=recorder)
    cache = recorder.fork(method, budget)
    budget_len = int(budget * (400 + steps))
    for full_layer, layer in zip(recorder.layers, cache.layers):
        assert layer.keys.shape[2] == budget_len  # real tensors, not masks
        # sinks and recent window bit-identical
        for a, b in ((full_layer.keys, layer.keys), (full_layer.values, layer.values)):
            assert torch.equal(a[:, :, :16], b[:, :, :16])
            assert torch.equal(a[:, :, -64:], b[:, :, -64:])
    heads, head_dim = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    per_entry = heads * (2 * head_dim * 4 + 4 + 4)  # float32 keys + values, log-degree, position (pre-RoPE)
    assert cache.kv_bytes() == len(cache.layers) * budget_len * per_entry
    assert recorder.kv_bytes() == len(cache.layers) * 400 * heads * 2 * head_dim * 4

    token = torch.tensor([[7]])
    for step in range(1, steps + 1):
        token = tiny_model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        assert max(cache.seq_lengths()) <= budget_len + method.compress_interval
        for layer in cache.layers:
            # degrees conserve tokens, per layer and head
            seen = torch.full(layer.main.log_degree.shape[:2], 400.0 + step)
            torch.testing.assert_close(layer.main.log_degree.exp().sum(-1), seen, rtol=1e-5, atol=0)
    assert cache.get_seq_length() == 400 + steps
    assert cache.n_compressions > 1


def test_positions_follow_tokens_seen_not_entries_stored(tiny_model):
    ids = prompt(300)
    cache = CompressedCache(
        get_method("centroidkv", chunk_size=32), budget=0.4, max_new_tokens=0, budget_unit="entries"
    )
    tiny_model(ids, past_key_values=cache)
    assert cache.seq_lengths()[0] == 120 and cache.get_seq_length() == 300
    twin = cache.fork(cache.method, 0.4)
    token = torch.tensor([[11]])
    implicit = tiny_model(token, past_key_values=cache).logits
    explicit = tiny_model(token, past_key_values=twin, cache_position=torch.tensor([300])).logits
    torch.testing.assert_close(implicit, explicit, atol=0, rtol=0)
    wrong = tiny_model(
        token, past_key_values=twin.fork(cache.method, 0.4), cache_position=torch.tensor([120])
    ).logits
    assert not torch.allclose(implicit, wrong, atol=1e-4)


def test_multi_token_step_over_compressed_cache_is_causal(tiny_model):
    """Feeding a question as one step equals feeding it token by token (the mask is aligned)."""
    ids, question = prompt(300), prompt(12, seed=5)
    recorder = CompressedCache("full", budget=1.0, budget_unit="entries")
    tiny_model(ids, past_key_values=recorder)
    one_step = recorder.fork(get_method("centroidkv", chunk_size=32), 0.4)
    with one_step.paused():
        logits_block = tiny_model(question, past_key_values=one_step).logits
    token_by_token = recorder.fork(get_method("centroidkv", chunk_size=32), 0.4)
    with token_by_token.paused():
        logits_steps = torch.cat(
            [
                tiny_model(question[:, i : i + 1], past_key_values=token_by_token).logits
                for i in range(question.shape[1])
            ],
            dim=1,
        )
    torch.testing.assert_close(logits_block, logits_steps, atol=1e-5, rtol=1e-5)
    assert one_step.seq_lengths()[0] == 120 + 12


def test_multi_token_step_matches_stock_without_compression(tiny_model):
    ids, question = prompt(200), prompt(9, seed=3)
    stock = stock_twin(tiny_model)
    reference_cache = DynamicCache()
    stock(ids, past_key_values=reference_cache)
    reference = stock(question, past_key_values=reference_cache).logits
    cache = CompressedCache("full", budget=1.0)
    tiny_model(ids, past_key_values=cache)
    torch.testing.assert_close(
        tiny_model(question, past_key_values=cache).logits, reference, atol=1e-5, rtol=0
    )


def test_batch_of_two_prompts(tiny_model):
    ids = prompt(300, batch=2)
    cache = CompressedCache(get_method("centroidkv", chunk_size=32), budget=0.5, max_new_tokens=20)
    out = tiny_model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=cache, pad_token_id=0)
    assert out.shape == (2, 320)
    single = CompressedCache(get_method("centroidkv", chunk_size=32), budget=0.5, max_new_tokens=20)
    alone = tiny_model.generate(
        ids[1:], max_new_tokens=20, do_sample=False, past_key_values=single, pad_token_id=0
    )
    assert torch.equal(out[1:], alone)


def test_padded_batch_is_refused(tiny_model):
    ids = prompt(50, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with pytest.raises(NotImplementedError, match="padded"):
        tiny_model(ids, attention_mask=mask, past_key_values=CompressedCache("full", 1.0))


def test_cache_refuses_unprepared_model(tiny_model):
    stock = stock_twin(tiny_model)
    with pytest.raises(RuntimeError, match="prepared by centroidkv"):
        stock(prompt(20), past_key_values=CompressedCache("full", 1.0))


class _FakeLayer:
    """A layer that is not split: its one group (`main`) is itself."""

    tracks_attention = False

    def __init__(self, log_degree):
        self.log_degree = log_degree
        self.main = self

    def is_split(self):
        return False

    def after_attention(self, planner, query, scaling, received=None):
        pass


class _FakeModule(torch.nn.Module):
    def __init__(self, log_degree):
        super().__init__()
        self.kv_layer = _FakeLayer(log_degree)


@pytest.mark.parametrize("q_len", [1, 4])
def test_attention_with_unit_degrees_equals_sdpa_and_duplicates_are_exact(q_len):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, q_len, 16, generator=gen)  # 4 query heads over 2 KV heads
    keys, values = torch.randn(1, 2, 30, 16, generator=gen), torch.randn(1, 2, 30, 16, generator=gen)
    expanded_k, expanded_v = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
    mask = torch.ones(q_len, 30, dtype=torch.bool).tril(diagonal=30 - q_len)
    reference = F.scaled_dot_product_attention(query, expanded_k, expanded_v, attn_mask=mask).transpose(1, 2)
    out, _ = degree_attention(_FakeModule(torch.zeros(1, 2, 30)), query, keys, values, None, scaling=0.25)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-5)

    # Duplicate the first 26 entries (the last q_len stay single: they are the new tokens); merged
    # with log 2 they must give the same output as the duplicated cache.
    old = 30 - q_len
    dup_k = torch.cat([keys[:, :, :old].repeat_interleave(2, dim=2), keys[:, :, old:]], dim=2)
    dup_v = torch.cat([values[:, :, :old].repeat_interleave(2, dim=2), values[:, :, old:]], dim=2)
    full, _ = degree_attention(_FakeModule(None), query, dup_k, dup_v, None, scaling=0.25)
    log_degree = torch.cat([torch.full((1, 2, old), math.log(2)), torch.zeros(1, 2, q_len)], dim=2)
    merged, _ = degree_attention(_FakeModule(log_degree), query, keys, values, None, scaling=0.25)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_stays_finite_with_degrees_up_to_1e5(tiny_model, dtype):
    model = copy.deepcopy(tiny_model).to(dtype)
    method = get_method("centroidkv", chunk_size=32, compress_interval=1)
    cache = CompressedCache(method, budget=0.3, max_new_tokens=10, budget_unit="entries")
    model(prompt(300), past_key_values=cache)
    for layer in cache.layers:
        # pretend every entry stands for 1e5+ tokens
        layer.main.log_degree = layer.main.log_degree + math.log(1e5)
    logits = model(torch.tensor([[5]]), past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    # A smaller budget puts every layer over it: compress_now must merge at these degrees.
    mass_before = [layer.main.log_degree.double().exp().sum(-1) for layer in cache.layers]
    lengths_before = cache.seq_lengths()
    cache.budget = 0.27
    cache.compress_now()
    for layer, length, mass in zip(cache.layers, lengths_before, mass_before, strict=True):
        assert layer.main.length == cache.group_plan(layer.layer_idx).budget_len < length
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        torch.testing.assert_close(layer.main.log_degree.double().exp().sum(-1), mass, rtol=1e-3, atol=0)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: get_method("centroidkv", chunk_size=3), "chunk_size must be even"),
        (lambda: get_method("centroidkv", r_init=0.0), "r_init"),
        (lambda: get_method("centroidkv", r_min=0.5, r_init=0.3), "r_min"),
        (lambda: get_method("centroidkv", n_sink=-1), "n_sink"),
        (lambda: get_method("centroidkv", compress_interval=0), "compress_interval"),
        (lambda: get_method("centroidkv", chunk=64), "unknown parameter"),
        (lambda: get_method("nope"), "unknown method"),
        (lambda: CompressedCache("centroidkv", budget=0.0), "budget"),
        (lambda: CompressedCache("centroidkv", budget=1.5), "budget"),
        (lambda: CompressedCache("centroidkv", budget=0.5, max_new_tokens=-3), "max_new_tokens"),
    ],
)
def test_bad_parameters_fail_with_one_clear_line(build, message):
    with pytest.raises(ValueError, match=message) as error:
        build()
    assert "\n" not in str(error.value)


def test_budget_too_small_for_protected_tokens_shrinks_them_and_one_of_no_entry_is_refused(tiny_model):
    cache = CompressedCache(get_method("centroidkv"), budget=0.1, max_new_tokens=0)
    tiny_model(prompt(300), past_key_values=cache)  # B < 81 protected: shorter windows (fit_protected)
    used = cache.protected_used()
    assert used["n_sink_used"] + used["n_recent_used"] < min(cache.seq_lengths())
    cache = CompressedCache(get_method("centroidkv"), budget=0.001, max_new_tokens=0)
    with pytest.raises(ValueError, match="no room for any token"):
        tiny_model(prompt(300), past_key_values=cache)


@pytest.mark.parametrize("q_len,block", [(1, None), (37, 8), (37, 64), (50, 16), (50, None)])
def test_attention_with_received_equals_eager_softmax(q_len, block):
    """The blocked, triangle-skipping pass gives SDPA's output and the summed masked softmax."""
    from centroidkv.attention import attention_with_received
    from centroidkv.cache.cache import causal_allowed

    generator = torch.Generator().manual_seed(q_len)
    kv_len, q_heads, kv_heads = 50, 6, 2
    query = torch.randn(2, q_heads, q_len, 16, generator=generator)
    keys = torch.randn(2, kv_heads, kv_len, 16, generator=generator)
    values = torch.randn(2, kv_heads, kv_len, 16, generator=generator)
    log_degree = torch.rand(2, kv_heads, kv_len, generator=generator)
    logits = query @ keys.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25
    logits = logits + log_degree.repeat_interleave(3, dim=1).unsqueeze(2)
    logits = logits.masked_fill(~causal_allowed(q_len, kv_len, keys.device), float("-inf"))
    probabilities = logits.softmax(-1)
    expected_received = probabilities.sum(dim=2).view(2, kv_heads, 3, kv_len).sum(dim=2)
    expected_output = probabilities @ values.repeat_interleave(3, dim=1)
    output, received = attention_with_received(query, keys, values, log_degree, 0.25, block=block)
    torch.testing.assert_close(received, expected_received, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)


def test_tracking_attention_does_not_change_the_answer(tiny_model):
    """A cache that records accumulated attention decodes exactly like one that does not."""
    ids = prompt(120)
    plain, _ = greedy(tiny_model, ids, CompressedCache("full", 1.0, 8), 8)
    tracked_cache = CompressedCache("full", 1.0, 8, needs=[ATTENTION_SUM])
    tracked, _ = greedy(tiny_model, ids, tracked_cache, 8)
    assert torch.equal(plain, tracked)
    sums = torch.stack([layer.main.extras.get("attention_sum").sum(-1) for layer in tracked_cache.layers])
    heads_per_kv = tiny_model.config.num_attention_heads // tiny_model.config.num_key_value_heads
    torch.testing.assert_close(sums, torch.full_like(sums, (120 + 8) * heads_per_kv))


def test_a_dropped_cache_is_freed_without_the_cycle_collector(tiny_model):
    """Layers refer to their cache weakly, so dropping a cache (or a fork) frees its tensors at once."""
    import gc
    import weakref

    gc.disable()
    try:
        cache = CompressedCache("centroidkv", 0.5, 4, needs=[ATTENTION_SUM])
        tiny_model(prompt(200), past_key_values=cache)
        fork = cache.fork("h2o", 0.5)
        refs = [weakref.ref(cache), weakref.ref(fork), weakref.ref(cache.layers[0])]
        del cache, fork
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()


def test_a_planned_generation_the_budget_cannot_hold_fails_at_the_prompt_with_one_line(tiny_model):
    """B = int(0.005 * (50 + 100)) = 0: the re-compression 89 tokens later could keep no entry, so
    the cache refuses at its first update, when it knows the prompt and max_new_tokens."""
    cache = CompressedCache("centroidkv", budget=0.005, max_new_tokens=100, budget_unit="entries")
    with pytest.raises(ValueError, match="keeps 0 entries: no room for any token") as raised:
        tiny_model(prompt(50), past_key_values=cache)
    assert "\n" not in str(raised.value)
    roomy = CompressedCache("centroidkv", budget=0.9, max_new_tokens=10, budget_unit="entries")  # B = 54
    tiny_model(prompt(50), past_key_values=roomy)  # 50 + 9 tokens never reach a compression
