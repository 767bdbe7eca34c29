"""Storage precision as a budget axis (`centroidkv.cache.quantization`, issue 30).

The quantizer (packing, KIVI's axes, the error bound); on a tiny random model in bfloat16 (a 16-bit
reference, as on a GPU): integer caches hold packed uint8 codes whose bytes, with every other tensor
the cache holds, are `kv_bytes()`; every method x precision stores R of the reference within 1 % at a
byte budget of 0.25 and 0.125, after the prefill compression and after re-compressions; dequantized
keys and values are within the format's bound of the originals. On the embedded model: the int8
cache's greedy answer is the float cache's on a needle prompt.
"""

from __future__ import annotations

import pytest
import torch

from centroidkv import get_method, load_model
from centroidkv.cache.quantization import (
    INTEGER_BITS,
    PackedCodes,
    StorageFormat,
    dequantize,
    error_bound,
    pack,
    quantize,
    unpack,
)
from centroidkv.methods import method_label, method_variant
from centroidkv.plan.decoding import generate_from, needs_of, prefill
from tests.test_embedded_model import needle_prompt
from tests.test_fork_storage import check_own_and_counted
from tests.test_head_policies import NATIVE, prompt

pytestmark = pytest.mark.usefixtures("one_thread")

PRECISIONS = ["bf16", "fp16", "int8", "int4", "int2"]
SMALL = {"n_sink": 4, "n_recent": 16, "compress_interval": 8, "kv_group": 16, "kv_residual": 32}
NEW_TOKENS = 40
PROMPT_LEN = 1400  # one entry per (layer, head) is < 1 % of the 0.125 target from about 1000 tokens


@pytest.fixture(scope="module")
def bf16_model():
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    return model


def build(name: str, precision: str, **extra):
    params = dict(SMALL, kv_precision=precision, **extra)
    if name in ("snapkv", "pyramidkv"):
        params["window_size"] = 8
    if name == "centroidkv":
        params.setdefault("heads", "none")
        params["chunk_size"] = 32
    return get_method(name, **params)


# ------------------------------------------------------------------------------------------ quantizer
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_are_packed_and_unpack_exactly(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantized_values_are_within_the_format_bound(bits, axis):
    generator = torch.Generator().manual_seed(bits)
    x = torch.randn(1, 2, 64, 64, generator=generator) * 4 + 1
    x[:, :, :, 3] *= 20  # an outlier channel, as keys have
    packed = quantize(x, bits, 32, axis)
    error = (dequantize(packed, torch.float32) - x).abs()
    bound = error_bound(packed)
    assert (error <= bound * (1 + 1e-5) + 1e-6).all()
    levels = 2**bits - 1  # the bound is what min-max codes allow, not a loose one
    assert error.max() > 0.2 * bound.max() and bound.max() < 2 * (x.amax() - x.amin()) / levels
    if axis == "channel":  # one scale per channel of a group of tokens
        assert packed.scale.shape == (1, 2, 2, 64)
    else:  # one scale per group of channels of a token
        assert packed.scale.shape == (1, 2, 64, 2)


def test_a_bad_storage_format_is_one_line():
    with pytest.raises(ValueError, match="kv_precision must be one of"):
        get_method("snapkv", kv_precision="int3")
    with pytest.raises(ValueError, match="kv_group must be a power of two"):
        get_method("centroidkv", kv_precision="int4", kv_group=24)
    with pytest.raises(ValueError, match="KIVI-2, KIVI-4"):
        get_method("kivi", kv_precision="int8")


def test_precision_names_the_run():
    assert (
        method_label("centroidkv", get_method("centroidkv", kv_precision="int8").params())
        == "CentroidKV @int8"
    )
    assert (
        method_variant("centroidkv", get_method("centroidkv", kv_precision="int8").params())
        == "centroidkv-int8"
    )
    assert method_label("kivi", get_method("kivi").params()) == "KIVI @int2"
    assert method_variant("kivi", get_method("kivi", kv_precision="int4").params()) == "kivi-int4"
    plain = get_method("centroidkv").params()  # the model's dtype: no storage parameter in the run
    assert not {"kv_precision", "kv_group", "kv_residual"} & set(plain)
    assert method_label("centroidkv", plain) == "CentroidKV"


# ------------------------------------------------------------------------------------------ the cache
@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
@pytest.mark.parametrize("name", ["full", "kivi", "centroidkv", "snapkv", "h2o"])
def test_integer_caches_hold_packed_codes_counted_in_kv_bytes(bf16_model, name, precision):
    if name == "kivi" and precision == "int8":
        pytest.skip("KIVI is 2- or 4-bit")
    method = build(name, precision)
    with torch.inference_mode():
        prefilled = prefill(bf16_model, prompt(PROMPT_LEN), NEW_TOKENS, needs=needs_of([method]))
        cache = prefilled.cache.fork(method, 0.25, NEW_TOKENS)
        check_own_and_counted(cache, prefilled.cache)
        token = prefilled.first_token
        for _ in range(20):  # through re-compressions and residual groups being quantized
            token = bf16_model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        check_own_and_counted(cache, prefilled.cache)
    bits = INTEGER_BITS[precision]
    for layer in cache.layers:
        assert set(layer.main.packed) == {"keys", "values"}
        for slot, packed in layer.main.packed.items():
            assert packed.codes.dtype == torch.uint8 and packed.codes.shape[-1] == 16 * bits // 8  # D = 16
            residual = layer.main._get(slot).shape[2]
            assert SMALL["kv_residual"] <= residual < SMALL["kv_residual"] + SMALL["kv_group"]
            assert packed.length % SMALL["kv_group"] == 0 and packed.length + residual == layer.main.length


def test_heads_kept_whole_and_favoured_heads_are_quantized_too(bf16_model, tmp_path):
    from tests.test_head_policies import head_file

    path = head_file(tmp_path, bf16_model)
    for policy in ("whole", "budget"):
        method = build(
            "centroidkv", "int4", heads=policy, heads_file=path, heads_fraction=0.25, heads_boost=2.0
        )
        with torch.inference_mode():
            prefilled = prefill(bf16_model, prompt(PROMPT_LEN), NEW_TOKENS, needs=needs_of([method]))
            cache = prefilled.cache.fork(method, 0.25, NEW_TOKENS)
            token = prefilled.first_token
            for _ in range(12):
                token = bf16_model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        check_own_and_counted(cache, prefilled.cache)
        layer = cache.layers[0]
        listed = layer.group("whole" if policy == "whole" else "favoured")
        assert set(listed.packed) == {"keys", "values"}
        assert cache.budget_ratio() <= 0.25 * 1.01 + 0.05  # g decoded tokens of slack


def stores_r(cache, budget: float, name: str) -> None:
    """What is stored is R of the reference within 1 %; PyramidKV on 2 layers may keep a whole layer
    (its budget above the layer's length) and then stores less (its known under-spend)."""
    ratio = cache.budget_ratio()
    if name == "pyramidkv" and any(layer.main.length == layer.n_seen for layer in cache.layers):
        assert ratio <= budget * 1.01
    else:
        assert ratio == pytest.approx(budget, rel=0.01)


@pytest.mark.parametrize("budget", [0.25, 0.125])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", NATIVE)
def test_every_method_and_precision_stores_r_after_every_compression(bf16_model, name, precision, budget):
    if name == "duo_attention":
        pytest.skip(
            "DuoAttention needs a streaming head file (test_head_policies); its cache is StreamingLLM's"
        )
    method = build(name, precision)
    with torch.inference_mode():
        prefilled = prefill(bf16_model, prompt(PROMPT_LEN), NEW_TOKENS, needs=needs_of([method]))
        cache = prefilled.cache.fork(method, budget, NEW_TOKENS)
        assert cache.n_compressions == 1
        stores_r(cache, budget, name)
        token, compressions = prefilled.first_token, 0
        for _ in range(3 * SMALL["compress_interval"]):
            before = cache.n_compressions
            token = bf16_model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            if cache.n_compressions > before:
                compressions += 1
                stores_r(cache, budget, name)
    assert compressions >= 2


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_dequantized_cache_is_within_the_bound_of_the_prefill(bf16_model, precision):
    method = build("full", precision)
    with torch.inference_mode():
        prefilled = prefill(bf16_model, prompt(PROMPT_LEN), NEW_TOKENS)
        cache = prefilled.cache.fork(method, 1.0, NEW_TOKENS)
    for original, layer in zip(prefilled.cache.layers, cache.layers, strict=True):
        for slot in ("keys", "values"):
            packed: PackedCodes = layer.main.packed[slot]
            restored = layer.read(slot).float()
            source = getattr(original, slot).float()
            quantized = slice(0, packed.length)
            error = (restored[:, :, quantized] - source[:, :, quantized]).abs()
            # the bound, plus the rounding of the dequantized copy to the model's bfloat16
            rounding = torch.finfo(torch.bfloat16).eps * restored[:, :, quantized].abs()
            assert (error <= error_bound(packed) * (1 + 1e-5) + rounding).all()
            assert torch.equal(restored[:, :, packed.length :], source[:, :, packed.length :])  # residual


def test_bytes_per_entry_follow_the_format():
    storage = StorageFormat("int4", 32, 128)  # D = 64: 2 x 32 bytes of codes + 8 + 8 bytes of scales/zeros
    assert storage.entry_bytes(64, 2, quantized=True) == 80
    assert StorageFormat("bf16").entry_bytes(64, 4, quantized=False) == 256
    assert storage.quantized_length(128 + 31) == 0 and storage.quantized_length(128 + 32) == 32


# ------------------------------------------------------------------------------------------ embedded
def test_int8_greedy_answer_equals_the_float_cache_s(embedded):
    model, tokenizer = embedded
    ids = needle_prompt(tokenizer)
    prefilled = prefill(model, ids, max_new_tokens=20)
    reference = generate_from(model, prefilled, "full", 1.0, 20, eos_token_ids=set())
    quantized = generate_from(
        model, prefilled, get_method("full", kv_precision="int8"), 1.0, 20, eos_token_ids=set()
    )
    assert quantized.tokens == reference.tokens
    assert "4827361" in tokenizer.decode(reference.tokens[0])
    # int8 codes of float32 values, with the newest 128 .. 159 of these ~640 tokens kept in float32
    assert quantized.kv_bytes < 0.5 * reference.kv_bytes


# ------------------------------------------------------------------------------------------ bench
def test_bench_decode_times_every_precision(capsys):
    from scripts.bench_decode import main

    main(
        [
            "--model",
            "tiny-llama",
            "--skip-decode",
            "--skip-csm",
            "--precision-lengths",
            "300",
            "--new-tokens",
            "4",
        ]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["model", "bf16", "fp16", "int8", "int4", "int2"]
    ratios = [float(row.split("|")[6]) for row in rows]  # the KV ratio falls with the bits
    assert ratios[3] > ratios[4] > ratios[5] and ratios[0] > ratios[3]


def test_bench_decode_refuses_an_unknown_precision():
    from scripts.bench_decode import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--precisions", "int3"])
    assert exit_.value.code == 2


def test_a_fork_to_another_format_requantizes_from_floats(bf16_model):
    """A fork of an int4 cache to int8 with another group, or back to the model's dtype, starts again
    from the dequantized entries (codes of two formats are never mixed)."""
    with torch.inference_mode():
        prefilled = prefill(bf16_model, prompt(PROMPT_LEN), NEW_TOKENS)
        int4 = prefilled.cache.fork(build("full", "int4"), 1.0, NEW_TOKENS)
        int8 = int4.fork(build("full", "int8", kv_group=32), 1.0, NEW_TOKENS)
        back = int4.fork(build("full", "model"), 1.0, NEW_TOKENS)
    for source, layer in zip(int4.layers, int8.layers, strict=True):
        assert layer.main.packed["keys"].bits == 8 and layer.main.packed["keys"].group == 32
        restored = layer.read("keys").float()
        assert (restored - source.read("keys").float()).abs().max() <= error_bound(
            layer.main.packed["keys"]
        ).max() + 0.02
    assert not any(layer.main.packed for layer in back.layers)
    assert torch.equal(back.layers[0].keys, int4.layers[0].read("keys"))
