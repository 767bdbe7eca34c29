"""The tokenizer files of a converted checkpoint, written so that every transformers 5.x the project
uses (the harness's and the serving venv's) loads the same tokenizer and gives the same ids.

transformers' GGUF reader leaves three traps in what `save_pretrained` writes:
  - a `tokenizer_class` picked from the GGUF's architecture (SmolLM2: `CodeLlamaTokenizer`), which
    one version ignores and another obeys, turning every space of SmolLM2's text into <|endoftext|>;
  - special tokens and a BOS template that differ from the original model's (SmolLM2's post-processor
    prepends <|im_start|>), fixed until now only when the harness loaded them;
  - Gemma's SentencePiece vocabulary read as a Unigram model, although its scores are BPE merge ranks
    (llama.cpp merges the adjacent pair whose joined piece scores highest): "capital" came out as
    "c ap it al", and transformers' GemmaTokenizer, which ignores the Unigram model, split text into
    single characters. Its user-defined pieces (runs of spaces and newlines) and control pieces
    (<start_of_turn>, ...) are matched whole before the merges, as SentencePiece and llama.cpp do;
    only the GGUF's token types tell them apart, so the rewrite reads them from the GGUF.

`write_portable_tokenizer` rewrites tokenizer.json and tokenizer_config.json in place: the model as
BPE with its merges ranked by score, the original's special tokens and BOS rule, and the plain
`PreTrainedTokenizerFast` class, which every version loads from tokenizer.json as written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Bumped whenever what `write_portable_tokenizer` writes changes: folders written before are rewritten.
TOKENIZER_LAYOUT = 2
PORTABLE_CLASS = "PreTrainedTokenizerFast"
# What tokenizer_config.json keeps: the rest were arguments of the class the GGUF reader picked
# (CodeLlama's infill tokens, which are not in SmolLM2's vocabulary, would be added as new ones).
KEPT_CONFIG_KEYS = (
    "added_tokens_decoder",
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "clean_up_tokenization_spaces",
    "model_max_length",
)
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
CONTROL, USER_DEFINED = 3, 4  # GGUF token types (tokenizer.ggml.token_type), as SentencePiece's


def gguf_token_types(gguf: Path) -> list[int]:
    """The type of each piece of a GGUF's vocabulary (1 normal, 3 control, 4 user-defined, 6 byte)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields["tokenizer.ggml.token_type"]
    return [int(field.parts[index][0]) for index in field.data]


def score_ranked_merges(pieces: list[tuple[str, float]], skipped: set[str]) -> list[list[str]]:
    """The BPE merges of a SentencePiece vocabulary whose score is a merge rank: every split of a
    piece into two pieces of the vocabulary is a merge, ranked by the joined piece's score (higher
    first), ties by the shorter left part. `skipped` pieces (special, byte) join nothing."""
    known = {piece for piece, _ in pieces} - skipped
    merges = []
    for piece, score in pieces:
        if piece in skipped:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                merges.append((-score, len(left), left, right))
    merges.sort(key=lambda merge: merge[:2])
    return [[left, right] for _, _, left, right in merges]


def restored_byte_pieces(pieces: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """`pieces` with the byte pieces the GGUF reader renamed given back their names: it writes Gemma's
    <0x09> as a tab, which the vocabulary also holds as a piece of its own further on, so that one
    id would vanish from the vocabulary."""
    last_index = {piece: index for index, (piece, _) in enumerate(pieces)}
    return [
        (f"<0x{ord(piece):02X}>", score)
        if last_index[piece] != index and len(piece) == 1 and ord(piece) < 256
        else (piece, score)
        for index, (piece, score) in enumerate(pieces)
    ]


def whole_pieces(pieces: list[tuple[str, float]], token_types: list[int]) -> list[dict]:
    """tokenizer.json's added tokens for the control pieces (special, matched as written) and the
    user-defined ones (matched after the spaces became ▁), each matched before the merges."""
    return [
        {
            "id": index,
            "content": piece,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": kind == USER_DEFINED,
            "special": kind == CONTROL,
        }
        for index, ((piece, _), kind) in enumerate(zip(pieces, token_types, strict=True))
        if kind in (CONTROL, USER_DEFINED)
    ]


def bpe_model(pieces: list[tuple[str, float]], unigram: dict, whole: set[str]) -> dict:
    """tokenizer.json's Unigram model of a SentencePiece BPE vocabulary as the BPE model it is."""
    skipped = whole | {piece for piece, _ in pieces if BYTE_PIECE.fullmatch(piece)}
    unknown = pieces[unigram["unk_id"]][0] if unigram.get("unk_id") is not None else None
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unknown,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": bool(unigram.get("byte_fallback")),
        "ignore_merges": False,
        "vocab": {piece: index for index, (piece, _) in enumerate(pieces)},
        "merges": score_ranked_merges(pieces, skipped),
    }


def bos_template(bos_token: str | None, bos_id: int | None) -> dict:
    """A post-processor that prepends `bos_token` to each sequence, or adds nothing (None)."""
    bos = [{"SpecialToken": {"id": bos_token, "type_id": 0}}] if bos_token is not None else []
    template = {
        "type": "TemplateProcessing",
        "single": [*bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            *bos,
            {"Sequence": {"id": "A", "type_id": 0}},
            *bos,
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {},
    }
    if bos_token is not None:
        template["special_tokens"] = {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}}
    return template


def portable_tokenizer_json(
    tokenizer_json: dict, bos_token: str | None, token_types: list[int] | None = None
) -> dict:
    """tokenizer.json with a BPE model for a SentencePiece vocabulary (Unigram: `token_types` needed),
    and a post-processor that prepends `bos_token` (None: nothing) where the file had a template (a
    byte-level one is kept)."""
    rewritten = dict(tokenizer_json)
    if tokenizer_json["model"]["type"] == "Unigram":
        if token_types is None:
            raise ValueError("a SentencePiece vocabulary is rewritten with its GGUF's token types")
        pieces = restored_byte_pieces([(piece, score) for piece, score in tokenizer_json["model"]["vocab"]])
        rewritten["added_tokens"] = whole_pieces(pieces, token_types)
        whole = {token["content"] for token in rewritten["added_tokens"]}
        rewritten["model"] = bpe_model(pieces, tokenizer_json["model"], whole)
    processor = tokenizer_json.get("post_processor")
    if processor is None or processor.get("type") == "TemplateProcessing":
        bos_id = rewritten["model"]["vocab"].get(bos_token) if bos_token is not None else None
        rewritten["post_processor"] = bos_template(bos_token, bos_id)
    return rewritten


def needs_gguf(folder: Path) -> bool:
    """Whether rewriting `folder`'s tokenizer takes its GGUF's token types (a Unigram model)."""
    return json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "Unigram"


def write_portable_tokenizer(
    folder: Path,
    gguf: Path | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    add_bos_token: bool | None = None,
) -> None:
    """Rewrite `folder`'s tokenizer.json and tokenizer_config.json to load alike everywhere (module
    docstring). `gguf`: the file it was converted from (read only when `needs_gguf`). `eos_token`,
    `pad_token`, `add_bos_token`: the original model's, when the converted files name others (None:
    as converted; the BOS rule then stays the file's own)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    if add_bos_token is None:  # as converted: a BOS only where the template had one
        template = json.dumps(tokenizer_json.get("post_processor") or {})
        add_bos_token = config.get("bos_token") is not None and f'"{config["bos_token"]}"' in template
    bos_token = config.get("bos_token") if add_bos_token else None
    kept = {key: config[key] for key in KEPT_CONFIG_KEYS if key in config}
    kept.update({key: value for key, value in (("eos_token", eos_token), ("pad_token", pad_token)) if value})
    kept.update({"tokenizer_class": PORTABLE_CLASS, "add_bos_token": add_bos_token, "add_eos_token": False})
    token_types = gguf_token_types(gguf) if gguf is not None and needs_gguf(folder) else None
    rewritten = portable_tokenizer_json(tokenizer_json, bos_token, token_types)
    _write_json(folder / "tokenizer.json", rewritten, indent=None)
    _write_json(folder / "tokenizer_config.json", kept, indent=2)


def _write_json(path: Path, content: dict, indent: int | None) -> None:
    """Write `path` whole or not at all (a temporary file beside it, renamed)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(content, indent=indent, ensure_ascii=False) + "\n")
    partial.replace(path)
