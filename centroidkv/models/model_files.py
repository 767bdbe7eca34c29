"""A user's model files, checked before anything loads them, torch-free: a folder must name no code of
its own and a model type transformers knows (the harness never runs a model folder's code); a .gguf
file must have a header that can be walked to its end.

transformers runs a folder's own Python when its config.json or tokenizer_config.json has an
`auto_map` and the caller trusts it, and asks on standard input when the caller says nothing (piped
input answers for the user). The harness refuses such a folder here, in one line, and passes
`trust_remote_code=False` wherever it loads a configuration, a model or a tokenizer
(`centroidkv.models.loading`), so that a Hub model with code is refused by transformers too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import mmap
import struct
from pathlib import Path

from centroidkv.errors import first_line

# The files of a folder where transformers looks for code of the model's own (their `auto_map`).
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json")


@functools.cache
def known_model_types() -> frozenset[str]:
    """The `model_type`s the installed transformers knows, read from its source without importing it
    (importing transformers imports torch); imported when the source cannot be read that way."""
    spec = importlib.util.find_spec("transformers")
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto" / "configuration_auto.py"
    try:
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "CONFIG_MAPPING_NAMES" for target in node.targets
            ):
                return frozenset(dict(ast.literal_eval(node.value.args[0])))
    except (OSError, SyntaxError, ValueError, AttributeError, IndexError, TypeError):
        pass
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def folder_code_problem(folder: Path) -> str | None:
    """Why a model folder must not be loaded (it names code of its own, or a model type transformers
    does not know, or its configuration cannot be read), or None."""
    config = None
    for file_name in CODE_NAMING_FILES:
        path = folder / file_name
        if file_name != "config.json" and not path.is_file():
            continue
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            return f"its {file_name} cannot be read ({first_line(error)})"
        if not isinstance(content, dict):
            return f"its {file_name} is not a JSON object"
        if "auto_map" in content:
            return (
                f"its {file_name} names code of its own (auto_map), and the harness never runs a model "
                "folder's code"
            )
        config = content if file_name == "config.json" else config
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in known_model_types():
        return (
            f"its config.json's model_type {str(model_type)[:40]!r} is not one transformers knows, and "
            "the harness never runs a model folder's code"
        )
    return None


# GGUF value types (the GGUF specification): the size of each fixed-size one; 8 a string, 9 an array.
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9
MAX_HEADER_BYTES = 64 << 20  # a header, its vocabulary included, is far smaller


class _Walk:
    """A bounded reader over a GGUF header: every length is checked against the bytes left."""

    def __init__(self, data: mmap.mmap, whole_file: bool):
        self.data, self.offset = data, 0
        self.end = "the end of the file" if whole_file else f"the first {len(data) >> 20} MiB"

    def take(self, count: int) -> bytes:
        if count < 0 or self.offset + count > len(self.data):
            raise ValueError(f"a length at byte {self.offset} runs past {self.end}")
        self.offset += count
        return self.data[self.offset - count : self.offset]

    def number(self, form: str) -> int:
        return struct.unpack("<" + form, self.take(struct.calcsize(form)))[0]

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in GGUF_SCALAR_BYTES:
            self.take(GGUF_SCALAR_BYTES[kind])
        elif kind == GGUF_STRING:
            self.take(self.number("Q"))
        elif kind == GGUF_ARRAY and depth == 0:
            item, count = self.number("I"), self.number("Q")
            if item in GGUF_SCALAR_BYTES:
                self.take(count * GGUF_SCALAR_BYTES[item])
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
        else:
            raise ValueError(f"value type {kind} at byte {self.offset} is not a GGUF type")


def gguf_header_problem(path: Path) -> str | None:
    """Why a .gguf file's header cannot be read (magic, version, the key-value pairs and the tensor
    descriptions, each length within the file), or None. Reads the header only, not the tensors."""
    size = path.stat().st_size
    if size < 24:
        return f"it has {size} bytes, fewer than a GGUF header's first fields"
    with (
        path.open("rb") as handle,
        mmap.mmap(handle.fileno(), min(size, MAX_HEADER_BYTES), access=mmap.ACCESS_READ) as data,
    ):
        return _walk_problem(_Walk(data, whole_file=size <= MAX_HEADER_BYTES), size)


def _walk_problem(walk: _Walk, size: int) -> str | None:
    """`gguf_header_problem` of the bytes `walk` reads."""
    try:
        if walk.take(4) != b"GGUF":
            return "it does not start with the GGUF magic"
        version = walk.number("I")
        if version not in (2, 3):
            return f"GGUF version {version} is not 2 or 3"
        n_tensors, n_values = walk.number("Q"), walk.number("Q")
        if n_tensors > size // 24 or n_values > size // 12:  # each needs at least that many bytes
            return f"its header counts {n_tensors} tensors and {n_values} values, more than the file holds"
        for _ in range(n_values):
            walk.take(walk.number("Q"))  # the key
            walk.value(walk.number("I"))
        for _ in range(n_tensors):
            walk.take(walk.number("Q"))  # the name
            walk.take(8 * walk.number("I") + 12)  # dimensions, type, offset
    except (ValueError, struct.error) as error:
        return f"its GGUF header is broken ({first_line(error)})"
    return None
