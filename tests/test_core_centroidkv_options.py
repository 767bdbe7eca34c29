"""CentroidKV's options: outlier heads kept whole, pre-RoPE similarity, the adaptive schedule."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from centroidkv import CompressedCache, get_method
from centroidkv.attention import degree_attention
from centroidkv.calibrate import worst_heads
from centroidkv.centroidkv import undo_rope
from centroidkv.csm import csm_compress
from centroidkv.head_scores import head_errors
from centroidkv.kv import LayerKV
from centroidkv.schedule import AdaptiveSchedule, LinearSchedule

pytestmark = pytest.mark.usefixtures("one_thread")


def prompt(length=300, seed=0):
    return torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(seed))


def head_file(tmp_path, model, errors, name=None) -> str:
    """A calibration file for `model` with the given per-(layer, head) errors."""
    config = model.config
    data = {
        "model": name or model.centroidkv_name,
        "budget": 0.25,
        "fraction": 0.04,
        "n_layers": config.num_hidden_layers,
        "n_kv_heads": config.num_key_value_heads,
        "errors": errors,
        "outliers": [],
    }
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(data))
    return str(path)


def greedy(model, cache, ids, steps):
    """Greedy tokens [1, steps] and the logits they came from [steps, vocab]."""
    logits = [model(ids, past_key_values=cache).logits[:, -1]]
    tokens = [logits[-1].argmax(-1, keepdim=True)]
    for _ in range(steps - 1):
        logits.append(model(tokens[-1], past_key_values=cache).logits[:, -1])
        tokens.append(logits[-1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), torch.cat(logits)


def test_every_head_an_outlier_gives_the_full_cache_tokens(tiny_model, tmp_path):
    ones = [[1.0] * tiny_model.config.num_key_value_heads] * tiny_model.config.num_hidden_layers
    path = head_file(tmp_path, tiny_model, ones)
    ids = prompt(300)
    full_tokens, full_logits = greedy(tiny_model, CompressedCache("full", 1.0, 40), ids, 40)
    method = get_method("centroidkv", chunk_size=32, heads_file=path, heads_fraction=1.0)
    cache = CompressedCache(method, 0.3, 40, budget_unit="entries")  # in bytes, whole heads exceed R
    tokens, logits = greedy(tiny_model, cache, ids, 40)
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=0)
    assert cache.head_lengths() == [[339, 339]] * 2  # every token kept, by every head
    compressed = CompressedCache(get_method("centroidkv", chunk_size=32), 0.3, 40, budget_unit="entries")
    _, compressed_logits = greedy(tiny_model, compressed, ids, 40)
    assert not torch.allclose(compressed_logits, full_logits, atol=1e-3)  # the test can tell them apart


def test_no_outlier_heads_is_the_plain_algorithm_bit_for_bit(tiny_model, tmp_path):
    """heads="none" = Chunked Soft Matching on every head, as before the option (with the
    parameters of that time: post-RoPE, constant r = 0.5)."""
    recorder = CompressedCache("full", 1.0, 0, budget_unit="entries")
    tiny_model(prompt(300), past_key_values=recorder)
    zero = head_file(tmp_path, tiny_model, [[1.0, 2.0]] * 2)
    before = dict(chunk_size=32, similarity="post_rope", schedule="linear", r_init=0.5, delta_r=0.0)
    for method in (
        get_method("centroidkv", heads="none", **before),
        get_method("centroidkv", heads_file=zero, heads_fraction=0.0, **before),
    ):
        cache = recorder.fork(method, 0.4)
        for source, layer in zip(recorder.layers, cache.layers, strict=True):
            middle = LayerKV(source.keys[:, :, 16:-64], source.values[:, :, 16:-64], torch.zeros(1, 2, 220))
            expected = csm_compress(middle, 120 - 80, 32, LinearSchedule(0.5, 0.0, 0.1))
            assert layer.group("whole") is None
            assert torch.equal(layer.keys[:, :, 16:-64], expected.keys)
            assert torch.equal(layer.values[:, :, 16:-64], expected.values)
            assert torch.equal(layer.main.log_degree[:, :, 16:-64], expected.log_degree)


def test_outlier_heads_are_stored_whole_and_bytes_are_the_stored_parts(tiny_model, tmp_path):
    path = head_file(tmp_path, tiny_model, [[0.0, 1.0], [1.0, 0.0]])  # layer 0 head 1, layer 1 head 0
    recorder = CompressedCache(
        "full", 1.0, 0, needs=get_method("centroidkv", similarity="pre_rope").needs(), budget_unit="entries"
    )
    tiny_model(prompt(300), past_key_values=recorder)
    method = get_method(
        "centroidkv", chunk_size=32, heads_file=path, heads_fraction=0.5, similarity="pre_rope"
    )
    cache = recorder.fork(method, 0.4)
    assert cache.head_lengths() == [[120, 300], [300, 120]]
    for layer, whole in zip(cache.layers, (1, 0), strict=True):
        assert layer.group("whole").heads.tolist() == [whole]
        assert torch.equal(layer.group("whole").keys[:, 0], recorder.layers[layer.layer_idx].keys[:, whole])
        assert layer.keys.shape[1] == 1  # the compressed tensor holds the other head only
    head_dim = tiny_model.config.hidden_size // tiny_model.config.num_attention_heads
    # per compressed entry: float32 key + value + log-degree + position; per whole entry: key + value;
    # per layer, the ids of its whole and its compressed head (int64)
    expected = 2 * (120 * (2 * head_dim * 4 + 4 + 4) + 300 * 2 * head_dim * 4 + 2 * 8)
    assert cache.kv_bytes() == expected
    assert cache.full_kv_bytes() == 2 * 2 * 300 * 2 * head_dim * 4
    assert cache.kv_ratio() == pytest.approx(expected / cache.full_kv_bytes())
    # decoding appends to both groups
    tiny_model(torch.tensor([[7]]), past_key_values=cache)
    assert cache.head_lengths() == [[121, 301], [301, 121]]


class _Group:
    """A head group as the attention reads it: its KV head ids, entries and log-degrees."""

    tracks_attention = False

    def __init__(self, heads, keys=None, values=None, log_degree=None):
        self.heads, self.keys, self.values, self.log_degree = torch.tensor(heads), keys, values, log_degree

    def read(self, name: str):  # the stored tensor, dequantized (here: stored as it is)
        return getattr(self, name)


class _SplitLayer:
    """A layer split in two groups: the compressed heads (the main group) and the heads kept whole."""

    def __init__(self, keys, values, log_degree, whole):
        rest = [h for h in range(keys.shape[1]) if h not in whole]
        self.main = _Group(rest, log_degree=log_degree)
        self.groups = [self.main, _Group(whole, keys[:, whole], values[:, whole])]

    def is_split(self):
        return True

    def after_attention(self, planner, query, scaling, received=None):
        pass


def test_under_gqa_an_outlier_heads_queries_see_all_its_entries():
    """3 KV heads x 2 query heads; KV head 1 kept whole (40 entries), heads 0 and 2 compressed (15)."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 1, 16, generator=gen)
    keys, values = torch.randn(1, 3, 40, 16, generator=gen), torch.randn(1, 3, 40, 16, generator=gen)
    compressed_k, compressed_v = keys[:, [0, 2], ::2][:, :, :15], values[:, [0, 2], ::2][:, :, :15]
    log_degree = torch.rand(1, 2, 15, generator=gen)
    module = torch.nn.Module()
    module.kv_layer = _SplitLayer(keys, values, log_degree, [1])
    out, _ = degree_attention(module, query, compressed_k, compressed_v, None, scaling=0.25)
    whole = F.scaled_dot_product_attention(query[:, 2:4], keys[:, [1, 1]], values[:, [1, 1]], scale=0.25)
    torch.testing.assert_close(out[:, :, 2:4], whole.transpose(1, 2))
    for kv_head, q_heads in ((0, slice(0, 2)), (1, slice(4, 6))):
        bias = log_degree[:, kv_head].view(1, 1, 1, 15)
        k, v = compressed_k[:, [kv_head] * 2], compressed_v[:, [kv_head] * 2]
        expected = F.scaled_dot_product_attention(query[:, q_heads], k, v, attn_mask=bias, scale=0.25)
        torch.testing.assert_close(out[:, :, q_heads], expected.transpose(1, 2))


def test_pre_rope_similarity_of_a_repeated_token_is_one_in_the_first_layer(embedded):
    """Layer 0's key depends only on the token (and its position through RoPE)."""
    model, tokenizer = embedded
    ids = tokenizer("The cat sat on the mat while the dog slept by the door.", return_tensors="pt").input_ids
    first, second = 1, ids.shape[1]
    ids = torch.cat([ids, ids[:, first : first + 1]], dim=1)  # the same token again, at the last position
    cache = CompressedCache("full", 1.0, 0, needs=get_method("centroidkv", similarity="pre_rope").needs())
    with torch.no_grad():
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    keys = layer.keys[:, :, [first, second]]
    post = F.cosine_similarity(keys[:, :, 0], keys[:, :, 1], dim=-1)
    pre_keys = undo_rope(keys, layer.main.extras["position"][:, :, [first, second]], cache.rotary[0])
    pre = F.cosine_similarity(pre_keys[:, :, 0], pre_keys[:, :, 1], dim=-1)
    torch.testing.assert_close(pre, torch.ones_like(pre), atol=1e-5, rtol=0)
    assert float(post.max()) < 0.99


@pytest.mark.parametrize(
    "length,target,chunk", [(400, 100, 32), (401, 37, 64), (64, 33, 16), (1000, 13, 256)]
)
@pytest.mark.parametrize("shape", ["random", "one_standout", "duplicates"])
def test_adaptive_schedule_always_reaches_the_budget(length, target, chunk, shape):
    gen = torch.Generator().manual_seed(length)
    keys = torch.randn(1, 2, length, 8, generator=gen)
    if shape == "one_standout":  # one near-duplicate pair, every other edge weak: few edges above the mean
        keys[:, :, 1] = keys[:, :, 0]
    elif shape == "duplicates":  # every A has an exact twin: all edges equal
        keys[:, :, 1::2] = keys[:, :, 0 : length - 1 : 2][:, :, : keys[:, :, 1::2].shape[2]]
    kv = LayerKV(keys, keys.clone(), torch.zeros(1, 2, length))
    out = csm_compress(kv, target, chunk, AdaptiveSchedule(r_min=0.1))
    assert out.length == target
    torch.testing.assert_close(out.log_degree.exp().sum(-1), torch.full((1, 2), float(length)))


def test_adaptive_merge_count_follows_the_similarity_distribution():
    schedule = AdaptiveSchedule(r_min=0.1)
    skewed = torch.tensor([[[0.9] + [0.1] * 99]])  # one edge stands out: the floor, 10
    assert schedule.merge_count(0, skewed, 100, 1000) == 10
    flat = torch.tensor([[[0.5] * 100]])  # all alike: every edge clears the mean
    assert schedule.merge_count(0, flat, 100, 1000) == 100
    two_level = torch.tensor([[[0.9] * 30 + [0.1] * 70 + [float("-inf")] * 5]])  # padding ignored
    assert schedule.merge_count(0, two_level, 100, 1000) == 30
    assert schedule.merge_count(0, two_level, 100, 7) == 7  # never beyond the excess


def test_auto_on_a_model_too_small_for_one_outlier_head_neither_reads_nor_calibrates(tiny_model, monkeypatch):
    import centroidkv.calibrate as calibrate

    monkeypatch.setattr(calibrate, "read_head_file", lambda *a, **k: pytest.fail("read a head file"))
    method = get_method("centroidkv", heads="whole")  # 4 % of 2 x 2 heads rounds to none
    assert method.listed_heads(tiny_model) == {}


def test_worst_heads_and_calibration_on_a_tiny_model(tiny_model):
    assert worst_heads([[0.1, 0.5], [0.3, 0.2]], 0.5) == {0: [1], 1: [0]}
    assert worst_heads([[0.1, 0.5], [0.3, 0.2]], 0.0) == {}
    errors = head_errors(tiny_model, [prompt(400, seed=1)], budget=0.3, n_queries=16)
    assert errors.shape == (2, 2) and bool((errors > 0).all()) and bool(errors.isfinite().all())


@pytest.mark.parametrize(
    "params,message",
    [
        ({"similarity": "cosine"}, "similarity must be one of"),
        ({"schedule": "cosine"}, "schedule must be one of"),
        ({"heads_fraction": 1.5}, "heads_fraction"),
        ({"heads_fraction": -0.1}, "heads_fraction"),
        ({"heads_file": "/nonexistent/heads.json"}, "does not exist"),
    ],
)
def test_bad_options_fail_with_one_clear_line(params, message):
    with pytest.raises(ValueError, match=message) as error:
        get_method("centroidkv", **params)
    assert "\n" not in str(error.value)


def test_a_head_file_of_another_model_is_refused(tiny_model, tmp_path):
    path = head_file(tmp_path, tiny_model, [[1.0, 0.0]] * 2, name="smollm2-135m")
    method = get_method("centroidkv", heads_file=path, heads_fraction=0.5)
    with pytest.raises(ValueError, match="calibrated on 'smollm2-135m'"):
        method.check_model("tiny-llama")  # what the runner's validation calls before loading a model
    with pytest.raises(ValueError, match="not 'tiny-"):
        tiny_model(prompt(300), past_key_values=CompressedCache(method, 0.3, 0))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_method("centroidkv", heads_file=str(broken))


def test_the_shipped_calibration_matches_the_embedded_model():
    from centroidkv.calibrate import packaged_head_file, read_head_file

    data = read_head_file(packaged_head_file("smollm2-135m"))
    assert (data["model"], data["n_layers"], data["n_kv_heads"]) == ("smollm2-135m", 30, 3)
    assert len(data["outliers"]) == round(0.04 * 90)
    assert math.isclose(data["fraction"], 0.04)


def test_settings_other_than_the_calibrated_ones_warn_once_in_one_line(tiny_model, tmp_path, capsys):
    """The head file records the settings its heads were chosen with; a run with other settings is
    told so once, in one line, and a run with the same settings is not."""
    errors = [[0.0, 1.0]] * tiny_model.config.num_hidden_layers
    path = Path(head_file(tmp_path, tiny_model, errors))
    data = json.loads(path.read_text())
    data["method"] = {
        k: v for k, v in get_method("centroidkv").params().items() if not k.startswith("outlier")
    }
    path.write_text(json.dumps(data))

    def run(**params) -> str:
        method = get_method("centroidkv", heads_file=str(path), heads_fraction=0.5, **params)
        tiny_model(prompt(300), past_key_values=CompressedCache(method, 0.6, 0, budget_unit="entries"))
        return capsys.readouterr().err

    assert run() == ""
    warned = run(chunk_size=32, schedule="linear")
    assert warned.count("\n") == 1 and "warning" in warned
    assert "chunk_size=32 (calibrated with 256)" in warned and "schedule='linear'" in warned
    assert run(chunk_size=32, schedule="linear") == ""  # once per file and difference
