"""What the harness knows of a model without loading it: names, the paper-shaped architectures, depths,
shapes, positions, and the cache directory. No weight, tokenizer or attention here, so that light
modules (head files, config validation) can ask; `centroidkv.models.loading` loads and re-exports these."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from centroidkv.models.model_names import (  # noqa: F401  (the names, read without torch, re-exported)
    EMBEDDED_MODEL,
    HUB_MODELS,
    MODEL_NAMES,
    PAPER_DEPTHS,
    RANDOM_MODELS,
    TINY_MODELS,
    cache_dir,
    canonical_model_name,
    check_model_name,
    local_config,
    model_identity,
    model_kind,
    parse_model_name,
)
from centroidkv.models.wheel_models import WHEEL_MODELS

# The published configurations (config.json of the HUB_MODELS checkpoints), architecture only.
_LLAMA_MISTRAL_7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PAPER_CONFIGS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "random-llama3.1-8b": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            _LLAMA_MISTRAL_7B,
            num_hidden_layers=PAPER_DEPTHS["random-llama3.1-8b"],
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "random-mistral-7b": (
        MistralConfig,
        MistralForCausalLM,
        dict(
            _LLAMA_MISTRAL_7B,
            num_hidden_layers=PAPER_DEPTHS["random-mistral-7b"],
            vocab_size=32768,
            max_position_embeddings=32768,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            sliding_window=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "random-qwen2-7b": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=PAPER_DEPTHS["random-qwen2-7b"],
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=32768,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
}
assert set(PAPER_CONFIGS) == set(PAPER_DEPTHS), "a paper-shaped model needs its depth in model_names"


EMBEDDED_SHAPE = (WHEEL_MODELS[EMBEDDED_MODEL].n_layers, WHEEL_MODELS[EMBEDDED_MODEL].n_kv_heads)
EMBEDDED_POSITIONS = WHEEL_MODELS[EMBEDDED_MODEL].positions


def known_config(name: str) -> dict | None:
    """The configuration values of any model that are known without loading a weight or reaching the
    Hub: the published ones of a registered random model, the shape of a wheel model, a folder's
    config.json, a hub model's config.json in the local Hugging Face cache; else None (a .gguf file, a
    hub model never downloaded). Multimodal configs give their text model's values."""
    kind = model_kind(name)
    if kind == "registered":
        base, depth = parse_model_name(name)
        if base in PAPER_CONFIGS:
            values = dict(PAPER_CONFIGS[base][2])
            values["num_hidden_layers"] = depth or values["num_hidden_layers"]
            return values
        if base in TINY_MODELS:
            return tiny_config(base).to_dict()
        if base in WHEEL_MODELS:
            return WHEEL_MODELS[base].declared_config
        config = _cached_hub_config(HUB_MODELS[base])
    elif kind == "hub":
        config = _cached_hub_config(name)
    else:
        config = local_config(name)
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return config if isinstance(config, dict) else None


def max_positions(name: str) -> int | None:
    """The positions a model attends over (its config's `max_position_embeddings`: prompt and
    generated tokens together), known without loading any weight; None when it is not known cheaply."""
    value = (known_config(name) or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cached_hub_config(repo_id: str) -> dict | None:
    """A hub model's config.json from the local Hugging Face cache (never downloaded), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
        if not isinstance(cached, str):  # None or a "known to be missing" marker
            return None
        config = json.loads(Path(cached).read_text())
        return config if isinstance(config, dict) else None
    except (ImportError, OSError, ValueError, KeyError):
        return None


def model_shape(name: str) -> tuple[int, int] | None:
    """(layers, KV heads) of a model, known without loading any weight (`known_config`); None when it
    is not known cheaply (callers then skip the shape check)."""
    config = known_config(name) or {}
    try:
        return int(config["num_hidden_layers"]), int(
            config.get("num_key_value_heads") or config["num_attention_heads"]
        )
    except (ValueError, KeyError, TypeError):
        return None


def head_file_identity_of(name: str) -> str:
    """The identity that keys a model's head files (`centroidkv.models.model_names.model_identity`), with a
    hub model's cached configuration hashed in when it is there."""
    kind = model_kind(name)
    if kind == "registered":
        return canonical_model_name(name)
    return model_identity(name, _cached_hub_config(name) if kind == "hub" else None)


def paper_config(name: str, n_layers: int | None = None) -> PretrainedConfig:
    """The published configuration of a paper-shaped model, optionally cut to its first `n_layers`."""
    config_class, _, values = PAPER_CONFIGS[name]
    values = dict(values)
    if n_layers is not None:
        values["num_hidden_layers"] = n_layers
    return config_class(**values)


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
