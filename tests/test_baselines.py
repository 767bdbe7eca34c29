"""One shared test matrix for every registered method, on tiny random Llama and Mistral models.

Like kvpress's default-presses list: each method goes through the same cache and the same checks:
budget after prefill and during 200 decode steps, protected tokens untouched, degrees conserved by
merging methods, batches of equal-length prompts, half precision, and bad parameters.
"""

from __future__ import annotations

import inspect
import math
import re
import sys

import pytest
import torch

from centroidkv import CompressedCache, get_method, load_model, method_names
from centroidkv.methods import method_class
from centroidkv.plan.prefill_compressor import compresses_in_prefill

pytestmark = pytest.mark.usefixtures("one_thread")

# Methods that compress the cache they are given (kvpress's presses compress inside their own prefill
# forward instead: tests/test_kvpress_methods.py).
METHODS = [name for name in method_names() if not compresses_in_prefill(method_class(name))]
MODELS = ("tiny-llama", "tiny-mistral")
PROMPT_LEN, NEW_TOKENS, BUDGET = 300, 200, 0.5

# Parameters a method must refuse besides the common ones, with a word the one-line message must
# contain (a method without an entry is checked with the common cases only).
BAD_PARAMS: dict[str, list[tuple[dict, str]]] = {
    "full": [],
    "centroidkv": [({"chunk_size": 3}, "chunk_size"), ({"r_init": 0.0}, "r_init")],
    "streaming_llm": [],
    "h2o": [({"recent_ratio": 1.5}, "recent_ratio"), ({"recent_ratio": 1.0}, "recent_ratio")],
    "snapkv": [
        ({"window_size": 0}, "window_size"),
        ({"kernel_size": 4}, "kernel_size"),
        ({"pooling": "mean"}, "pooling"),
        ({"window_size": 64, "n_recent": 32}, "n_recent"),
    ],
    "pyramidkv": [({"beta": 0.5}, "beta"), ({"kernel_size": 2}, "kernel_size")],
    "kmeans": [
        ({"iterations": 0}, "iterations"),
        ({"init": "kmeans++"}, "init"),
        ({"cosine": "yes"}, "cosine"),
    ],
    "kvpress": [
        ({"press": "NoSuchPress"}, "NoSuchPress"),
        ({"press_params": {"window_sz": 8}}, "window_sz"),
        ({"press": "SnapKVPress", "press_params": {"compression_ratio": 0.5}}, "compression_ratio"),
        ({"press": "DecodingPress", "press_params": {"base_press": "KnormPress"}}, "decoding only"),
        ({"press": "ThinKPress"}, "compression ratio"),
    ],
    "cam": [
        ({"merge_budget": 0}, "merge_budget"),
        ({"seed": -1}, "seed"),
        ({"recent_ratio": -0.1}, "recent_ratio"),
    ],
}
COMMON_BAD = [
    ({"n_sink": -1}, "n_sink"),
    ({"n_recent": 1.5}, "n_recent"),
    ({"compress_interval": 0}, "compress_interval"),
]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return load_model(request.param)[0]


def prompt(length: int = PROMPT_LEN, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_step(model, cache, token: torch.Tensor) -> torch.Tensor:
    logits = model(token, past_key_values=cache).logits[:, -1]
    assert torch.isfinite(logits).all()
    return logits.argmax(-1, keepdim=True)


@pytest.mark.parametrize("name", METHODS)
@torch.no_grad()
def test_budget_protected_tokens_and_degrees(model, name):
    """Budget after prefill and during 200 decode steps; sinks and recent window bit-identical;
    sum of degrees = tokens seen for merging methods, all degrees 1 for the others."""
    method = get_method(name)
    if method.kv_precision != "model":
        pytest.skip("stores integer codes, not the tokens bit for bit: tests/test_quantization.py")
    ids = prompt()
    # The reference takes the same attention path (tracking attention computes it blockwise).
    full = CompressedCache("full", 1.0, NEW_TOKENS, needs=method.needs())
    cache = CompressedCache(method, BUDGET, NEW_TOKENS)
    model(ids, past_key_values=full)
    token = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)

    n_sink, n_recent = method.n_sink, method.n_recent
    for layer, reference in zip(cache.layers, full.layers, strict=True):
        budget = cache.group_plan(layer.layer_idx).budget_len
        if method.compresses:
            assert layer.main.length == min(PROMPT_LEN, budget)
        else:
            assert layer.main.length == PROMPT_LEN
        for kept, original in ((layer.keys, reference.keys), (layer.values, reference.values)):
            assert torch.equal(kept[:, :, :n_sink], original[:, :, :n_sink])
            assert torch.equal(
                kept[:, :, kept.shape[2] - n_recent :], original[:, :, PROMPT_LEN - n_recent :]
            )
    sinks = [layer.keys[:, :, :n_sink] for layer in cache.layers]

    longest = [0] * len(cache.layers)
    compressions_after_prefill = cache.n_compressions
    for _ in range(NEW_TOKENS):
        before = [(layer.keys, layer.values, layer.main.n_compressions) for layer in cache.layers]
        token = greedy_step(model, cache, token)
        for i, (layer, (keys, values, count)) in enumerate(zip(cache.layers, before, strict=True)):
            longest[i] = max(longest[i], layer.main.length)
            if layer.main.n_compressions > count and n_recent:  # compressed during this step
                # the entries before the step, plus the new token, end with the untouched window
                expected_keys = torch.cat([keys, layer.keys[:, :, -1:]], dim=2)[:, :, -n_recent:]
                expected_values = torch.cat([values, layer.values[:, :, -1:]], dim=2)[:, :, -n_recent:]
                assert torch.equal(layer.keys[:, :, -n_recent:], expected_keys)
                assert torch.equal(layer.values[:, :, -n_recent:], expected_values)

    seen = PROMPT_LEN + NEW_TOKENS
    for layer, length, sink in zip(cache.layers, longest, sinks, strict=True):
        assert torch.equal(layer.keys[:, :, :n_sink], sink)
        if method.compresses:
            assert length <= cache.group_plan(layer.layer_idx).budget_len + method.compress_interval
        else:
            assert layer.main.length == seen
        if method.merges:
            degrees = layer.main.log_degree.double().exp().sum(dim=-1)
            torch.testing.assert_close(degrees, torch.full_like(degrees, seen), rtol=1e-4, atol=0)
        elif layer.main.log_degree is not None:
            assert torch.equal(layer.main.log_degree, torch.zeros_like(layer.main.log_degree))
    if method.compresses:
        assert cache.n_compressions > compressions_after_prefill  # decoding re-compressed


@pytest.mark.parametrize("name", METHODS)
@torch.no_grad()
def test_batch_of_two_matches_single_prompts(model, name):
    """Two equal-length prompts in one batch give each prompt its own cache, after the prefill
    compression and after a decoding re-compression (CaM: its random draws depend on the batch
    shape, so only shapes and finiteness are compared)."""
    steps = 70
    ids = prompt(batch=2, seed=1)
    batched = CompressedCache(get_method(name), BUDGET, steps)
    tokens = [model(ids, past_key_values=batched).logits[:, -1].argmax(-1, keepdim=True)]
    after_prefill = [layer.keys for layer in batched.layers]
    for _ in range(steps):
        tokens.append(greedy_step(model, batched, tokens[-1]))
    assert all(layer.keys.shape[0] == 2 for layer in batched.layers)
    if name == "cam" or not get_method(name).rows_independent:  # CentroidKV adaptive: one count per batch
        return
    for row in range(2):
        single = CompressedCache(get_method(name), BUDGET, steps)
        model(ids[row : row + 1], past_key_values=single)
        for keys, layer in zip(after_prefill, single.layers, strict=True):
            torch.testing.assert_close(keys[row : row + 1], layer.keys, rtol=1e-4, atol=1e-5)
        for token in tokens[:-1]:  # feed the batch's tokens so both decode the same sequence
            model(token[row : row + 1], past_key_values=single)
        for layer_b, layer_s in zip(batched.layers, single.layers, strict=True):
            torch.testing.assert_close(layer_b.keys[row : row + 1], layer_s.keys, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", METHODS)
@torch.no_grad()
def test_half_precision_stays_finite(name, dtype):
    model = _half_model(dtype)
    cache = CompressedCache(get_method(name), BUDGET, 70)
    token = model(prompt(), past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(70):
        token = greedy_step(model, cache, token)
    for layer in cache.layers:
        assert (
            layer.keys.dtype == dtype
            and torch.isfinite(layer.keys).all()
            and torch.isfinite(layer.values).all()
        )
        if layer.main.log_degree is not None:
            assert torch.isfinite(layer.main.log_degree).all()
    if get_method(name).compresses:
        assert cache.n_compressions >= 2


_HALF_MODELS: dict[torch.dtype, torch.nn.Module] = {}


def _half_model(dtype: torch.dtype):
    if dtype not in _HALF_MODELS:
        _HALF_MODELS[dtype] = load_model("tiny-llama", dtype=dtype)[0]
    return _HALF_MODELS[dtype]


@pytest.mark.parametrize("name", method_names())
def test_bad_parameters_rejected_with_one_clear_line(name):
    cases = COMMON_BAD + BAD_PARAMS.get(name, []) + [({"no_such_parameter": 1}, "no_such_parameter")]
    for params, word in cases:
        with pytest.raises(ValueError) as error:
            get_method(name, **params)
        message = str(error.value)
        assert word in message and name in message and "\n" not in message, (
            f"get_method({name!r}, **{params}) must refuse with one ValueError line naming the method "
            f"and {word!r} (README.md, Extending); got {message!r}"
        )


def own_docstring(cls: type) -> str:
    """The docstring the method's author wrote: the class's own, else its module's. `@dataclass`
    fills a missing class docstring with the signature (`Name(a: int = 1)`), which does not count."""
    generated = cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
    text = (cls.__dict__.get("__doc__") or "").strip()
    if not text or text == generated:
        text = (sys.modules[cls.__module__].__doc__ or "").strip()
    return text


# What a method file's docstring must hold (README.md, "Extending"): each rule in words, and its check.
ARXIV_ID = re.compile(r"arXiv[: ]*\d{4}\.\d{4,5}")
DOCSTRING_RULES = (
    ("cite its paper (a `Paper:` line, or an arXiv id such as arXiv:2506.11418)",
     lambda text: "Paper:" in text or ARXIV_ID.search(text) is not None),
    ("have a `Parameters` section (its fields and what each does)", lambda text: "Parameters" in text),
)  # fmt: skip


def broken_docstring_rules(cls: type) -> list[str]:
    """The rules (DOCSTRING_RULES) a method's own docstring (`own_docstring`) breaks, in words: a
    compressing method's must cite its paper and state its parameters; the full cache's needs only
    to exist."""
    text = own_docstring(cls)
    if not text:
        return ["have a docstring of its own (the class's, or its module's)"]
    return [rule for rule, holds in DOCSTRING_RULES if not holds(text)] if cls.compresses else []


@pytest.mark.parametrize("name", method_names())
def test_every_method_documents_its_paper_and_parameters(name):
    cls = method_class(name)
    broken = broken_docstring_rules(cls)
    assert not broken, (
        f"{cls.__module__}.{cls.__name__}: a method's docstring (the class's or its module's) must "
        f"{' and '.join(broken)} (README.md, Extending)"
    )


def test_the_docstring_check_rejects_an_undocumented_method():
    from dataclasses import dataclass

    from centroidkv.methods import Method

    @dataclass
    class Undocumented(Method):  # no class docstring: @dataclass writes the signature into __doc__
        name = "undocumented"
        window: int = 3

    assert Undocumented.__doc__ and "window" in Undocumented.__doc__
    Undocumented.__module__ = "types"  # a module whose docstring cites no paper
    assert broken_docstring_rules(Undocumented) == [rule for rule, _ in DOCSTRING_RULES]


def test_the_docstring_check_names_the_rule_a_method_breaks():
    """Issue 54, item 5. Before: a method whose docstring lacked a Parameters section failed with its
    own docstring echoed ("Keep the target_len entries ... Paper: none."), not the rule it broke."""
    from dataclasses import dataclass

    from centroidkv.methods import Method

    @dataclass
    class NoParameters(Method):
        """Keep the target_len entries with the largest key norm. Paper: none."""

        name = "no_parameters"
        window: int = 3

    assert broken_docstring_rules(NoParameters) == [
        "have a `Parameters` section (its fields and what each does)"
    ]


def test_pyramidkv_budgets_decrease_and_keep_the_total():
    method = get_method("pyramidkv")
    for budget, layers in ((250, 2), (1024, 30), (333, 7)):
        per_layer = [method.layer_budget(budget, i, layers) for i in range(layers)]
        assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]
        assert sum(per_layer) == budget * layers
        middle = budget - method.n_sink - method.n_recent
        assert math.isclose(per_layer[-1] - method.n_recent, middle / method.beta, abs_tol=1)


def test_streaming_llm_keeps_the_newest_middle_tokens():
    method = get_method("streaming_llm")
    kv, stats = _segment(length=40)
    kept = method.compress(kv, 10, stats)
    assert torch.equal(kept.keys, kv.keys[:, :, -10:])


def test_h2o_keeps_heavy_hitters_and_its_recent_share():
    method = get_method("h2o", n_recent=4, recent_ratio=0.5)
    kv, stats = _segment(length=40)
    kv.attention_sum = torch.zeros(1, 2, 40)
    kv.attention_sum[..., [3, 7, 11]] = torch.tensor([5.0, 9.0, 7.0])
    kept = method.compress(kv, 10, stats)  # B = 10 + 0 + 4: 7 recent = 4 protected + the middle's last 3
    expected = torch.tensor([0, 1, 2, 3, 4, 7, 11, 37, 38, 39])  # 7 by score, zero-score ties: earliest
    assert torch.equal(kept.keys, kv.keys[:, :, expected])
    # ties go to the earlier token
    kv.attention_sum = torch.ones(1, 2, 40)
    kept = get_method("h2o", n_recent=0, recent_ratio=0.0).compress(kv, 5, stats)
    assert torch.equal(kept.keys, kv.keys[:, :, :5])


def test_kmeans_recovers_duplicates_exactly_and_handles_empty_clusters():
    """Four groups of identical tokens -> four centroids equal to them with degree = group size;
    asking for more clusters than distinct keys still yields exactly k non-empty entries."""
    torch.manual_seed(0)
    base = torch.randn(1, 2, 4, 8)
    group = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 3, 3, 0, 2])
    kv, stats = _segment(length=12)
    kv.keys, kv.values = base[:, :, group], base[:, :, group] * 2
    for init in ("uniform", "random"):
        for cosine in (True, False):
            out = get_method("kmeans", init=init, cosine=cosine, iterations=5).compress(kv, 4, stats)
            sizes = out.log_degree.exp().round()
            assert sorted(sizes[0, 0].tolist()) == [2.0, 3.0, 3.0, 4.0]
            torch.testing.assert_close(out.values, out.keys * 2)
            many = get_method("kmeans", init=init, cosine=cosine).compress(kv, 9, stats)
            assert many.length == 9 and torch.isfinite(many.log_degree).all()
            torch.testing.assert_close(many.log_degree.exp().sum(-1), torch.full((1, 2), 12.0))


def test_kmeans_with_one_cluster_per_token_is_the_identity():
    kv, stats = _segment(length=50)
    for cosine in (True, False):
        out = get_method("kmeans", cosine=cosine, iterations=3).compress(kv, 50, stats)
        torch.testing.assert_close(out.keys, kv.keys)
        torch.testing.assert_close(out.values, kv.values)
        assert torch.equal(out.log_degree, torch.zeros_like(out.log_degree))


def test_kmeans_stopping_at_a_fixed_point_changes_nothing():
    """Ending Lloyd's loop once no assignment changes gives exactly the all-iterations result."""
    from baselines.kmeans import kmeans_compress

    kv, _ = _segment(length=300)
    for cosine in (True, False):
        early = kmeans_compress(kv, 60, iterations=30, cosine=cosine, stop_at_fixed_point=True)
        every = kmeans_compress(kv, 60, iterations=30, cosine=cosine, stop_at_fixed_point=False)
        for name in ("keys", "values", "log_degree"):
            assert torch.equal(getattr(early, name), getattr(every, name))


def test_cam_merges_evicted_values_into_kept_neighbours():
    """Evicted values go to the m kept tokens that follow (the last m when none follow), divided by
    m, when their attention is prominent (p = 1) and not at all when it is zero (p = 0); keys and
    degrees are untouched."""
    kv, stats = _segment(length=6)
    kv.attention_sum = torch.tensor([4.0, 0.0, 4.0, 4.0, 4.0, 4.0]).expand(1, 2, 6).clone()
    out = get_method("cam", n_recent=0, recent_ratio=0.0, merge_budget=2).compress(kv, 3, stats)
    # kept: 0, 2, 3 (ties -> earlier); evicted 1 (p = 0/4), 4 and 5 (p = 4/4, window clamped to {2, 3})
    assert torch.equal(out.keys, kv.keys[:, :, [0, 2, 3]])
    assert torch.equal(out.log_degree, torch.zeros(1, 2, 3))
    share = (kv.values[:, :, 4] + kv.values[:, :, 5]) / 2
    torch.testing.assert_close(out.values[:, :, 0], kv.values[:, :, 0])
    torch.testing.assert_close(out.values[:, :, 1], kv.values[:, :, 2] + share)
    torch.testing.assert_close(out.values[:, :, 2], kv.values[:, :, 3] + share)


def _segment(length: int):
    from centroidkv.methods import LayerKV, LayerStats

    torch.manual_seed(1)
    keys = torch.randn(1, 2, length, 8)
    kv = LayerKV(keys, torch.randn(1, 2, length, 8), torch.zeros(1, 2, length))
    stats = LayerStats(layer_idx=0, n_layers=2, scaling=8**-0.5, keys=keys, middle=slice(0, length))
    return kv, stats
