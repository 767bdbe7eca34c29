"""A converted checkpoint's tokenizer files load alike everywhere (centroidkv.models.tokenizer_files): a
SentencePiece vocabulary becomes the BPE its scores rank, whole pieces stay whole, the class is the
plain one, the original's special tokens and BOS rule are in the files. The serving venv's half of
the check (same ids under its transformers) is tests_serve/test_tokenizer.py."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from centroidkv.models.tokenizer_files import (
    CONTROL,
    PORTABLE_CLASS,
    USER_DEFINED,
    portable_tokenizer_json,
    write_portable_tokenizer,
)

NORMAL = 1
# A SentencePiece BPE vocabulary whose score is minus the merge rank, as Gemma's GGUF holds it: "▁abc"
# is learnt after "▁a" and "bc", so a Unigram model scores it below those two and never picks it.
PIECES = [
    ("<unk>", 0.0, CONTROL),
    ("<bos>", 0.0, CONTROL),
    ("<ctl>", 0.0, CONTROL),
    ("\u2581\u2581", 0.0, USER_DEFINED),
    ("\u2581a", -1.0, NORMAL),
    ("bc", -1.5, NORMAL),
    ("\u2581ab", -2.0, NORMAL),
    ("\u2581abc", -3.0, NORMAL),
    ("b", -4.0, NORMAL),
    ("c", -5.0, NORMAL),
    ("a", -6.0, NORMAL),
    ("\u2581", -7.0, NORMAL),
    ("<0x09>", 0.0, 6),
]


def gguf_style_unigram() -> dict:
    """tokenizer.json as transformers' GGUF reader writes Gemma's: Unigram, spaces as \u2581."""
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
            for i, (p, _, kind) in enumerate(PIECES[:2])
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}]}
        | {"pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}},
        "decoder": {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        "model": {
            "type": "Unigram",
            "unk_id": 0,
            "byte_fallback": True,
            "vocab": [[p, s] for p, s, _ in PIECES],
        },
    }


def pieces_of(tokenizer_json: dict, text: str) -> list[str]:
    return Tokenizer.from_str(json.dumps(tokenizer_json)).encode(text).tokens


def test_a_sentencepiece_vocabulary_is_merged_in_score_order_not_picked_as_unigram():
    unigram = gguf_style_unigram()
    assert pieces_of(unigram, " abc") != ["\u2581abc"]  # what the GGUF reader's file gives
    portable = portable_tokenizer_json(unigram, "<bos>", [kind for _, _, kind in PIECES])
    assert portable["model"]["type"] == "BPE"
    assert pieces_of(portable, " abc") == ["<bos>", "\u2581abc"]
    assert pieces_of(portable, " ab c") == ["<bos>", "\u2581ab", "\u2581", "c"]


def test_user_defined_and_control_pieces_are_matched_whole_before_the_merges():
    portable = portable_tokenizer_json(gguf_style_unigram(), None, [kind for _, _, kind in PIECES])
    # two spaces are the user-defined piece even where "▁a" would merge first; no BOS asked for
    assert pieces_of(portable, "  abc") == ["\u2581\u2581", "a", "bc"]
    assert pieces_of(portable, "<ctl> abc") == ["<ctl>", "\u2581abc"]
    added = {token["content"]: token for token in portable["added_tokens"]}
    assert added["<ctl>"]["special"] and not added["\u2581\u2581"]["special"]


def test_a_sentencepiece_vocabulary_without_its_token_types_is_refused():
    with pytest.raises(ValueError, match="token types"):
        portable_tokenizer_json(gguf_style_unigram(), None)


def test_the_embedded_models_files_name_the_plain_class_and_its_own_special_tokens(tmp_path):
    """SmolLM2's GGUF conversion named CodeLlamaTokenizer (transformers 5.19 then split every space
    off as <|endoftext|>), <|im_start|> as end of sequence, and a template prepending <|im_start|>."""
    from centroidkv.models.loading import _embedded_dir

    config = json.loads((_embedded_dir() / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == PORTABLE_CLASS and config["eos_token"] == "<|im_end|>"
    assert not config["add_bos_token"] and "prefix_token" not in config
    tokenizer = AutoTokenizer.from_pretrained(_embedded_dir())
    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids == [504, 3575, 282, 4649, 314]  # no BOS, no <|endoftext|> between the words


def test_rewriting_keeps_a_byte_level_post_processor_and_is_idempotent(tmp_path):
    """Qwen's byte-level post-processor is not a BOS template: it stays as it was."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tokenizer_json = gguf_style_unigram() | {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
    tokenizer_json["post_processor"] = byte_level
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    write_portable_tokenizer(tmp_path, eos_token="<eos>")
    first = [(tmp_path / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")]
    write_portable_tokenizer(tmp_path, eos_token="<eos>")
    assert [(tmp_path / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")] == first
    assert json.loads(first[0])["post_processor"] == byte_level
    assert json.loads(first[1])["tokenizer_class"] == PORTABLE_CLASS
