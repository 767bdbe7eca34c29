"""kvpress: any press of NVIDIA's kvpress library run as a method of this harness.

Library: kvpress (github.com/NVIDIA/kvpress, version 0.5.5), a collection of KV-cache compression
methods ("presses"). Paper: each press cites its own in its kvpress docstring (e.g. SnapKVPress:
Li et al., arXiv 2404.14469). Install with `pip install -e ".[kvpress]"`.

How it runs:
- A press compresses inside a prefill forward, through its own forward hook on each attention layer,
  on this harness's model (our attention runs under kvpress's attention wrapper) and on this
  harness's `CompressedCache`. With `share_prefill` (the default) one prefill of the context serves
  every press and budget of a job: after each layer, each press runs its own hook on that layer's
  call against its own fork of the cache (`PressTap`, a `centroidkv.plan.decoding.PrefillTap`), while
  the prefill goes on with the full cache (the same forward as a prefill of its own, tested). Its
  compression time is its `compress_s`. Presses that do more than hook one forward (`OWN_PREFILL`,
  with the reasons) and every press under `share_prefill=false` get their own prefill per
  (sample, budget), kvpress's own way: there the compression is part of `prefill_s`.
  Random presses draw from a generator seeded with PRESS_SEED at the start of their prefill.
- Protocol: context-only, kvpress's own: the context is prefilled and compressed, then the question
  is fed and the answer decoded on the compressed cache. Records of a press always say
  `protocol: context_only`.
- Budget: a press keeps B = int(R * (n + Gamma)) entries (`centroidkv.cache.budget.budget_entries`) for an
  n-token context and Gamma = max_new_tokens: its `compression_ratio` is 1 - B / n (nudged so that
  kvpress's int(n * (1 - ratio)) is exactly B). A press stores keys and values only, so B is the same
  under both budget units. A press not set by a compression ratio is refused (one line).
- Decode-time compression: only through kvpress's `PrefillDecodingPress` (its prefill press takes
  the budget, its decoding press compresses every `compression_interval` steps to `target_size`).
  A bare `DecodingPress` compresses nothing during prefill, so the budget cannot drive it: refused.
- Memory: presses that shrink the tensors report the real `kv_bytes`. Presses that evict head-wise
  by masking keys instead (AdaKV-style, e.g. AdaKVPress, CriticalAdaKVPress, DuoAttentionPress,
  KVzipPress) keep every tensor full-size: their records have `kv_masked: true`, tables mark them
  "[masked]", and their kv_bytes is the full cache's, i.e. no memory is saved.

Parameters:
  press: the kvpress class name, e.g. "SnapKVPress" (default), "TOVAPress", "AdaKVPress".
  press_params: the press's own parameters (not compression_ratio, which comes from the budget).
    A wrapper's inner press (fields press, base_press, prefilling_press, decoding_press) is given by
    its class name or as a mapping {"press": "<ClassName>", <its parameters>...}, e.g.
    `method.params.press=AdaKVPress +method.params.press_params.press=SnapKVPress`.
  n_sink, n_recent, compress_interval: unused (the press decides what it keeps).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from centroidkv.attention import attention_modules
from centroidkv.cache.budget import budget_entries
from centroidkv.errors import first_line
from centroidkv.methods import LayerKV, LayerStats, Method, register
from centroidkv.params import did_you_mean, param

EXTRA = 'kvpress is not installed: pip install -e ".[kvpress]"'
INNER_FIELDS = ("press", "base_press", "prefilling_press", "decoding_press")
NOT_PRESSES = ("BasePress", "ScorerPress")  # abstract bases

# Presses the zoo (configs/experiment/kvpress_zoo.yaml, `make zoo`) does not run, with the reason;
# `python -m baselines.kvpress_press skips` prints one line each. Measured with kvpress 0.5.5, offline,
# on the embedded model. Every other press is in the zoo (tests/test_kvpress_methods.py checks it).
ZOO_SKIPS = {
    # artefacts from the Hugging Face Hub
    "QFilterPress": "needs its Q-filters for the model from the Hub (nthngdy/<model>_qfilt)",
    "DuoAttentionPress": "needs its streaming-head patterns from the Hub, or scores them on a Hub dataset",
    "ExpectedAttentionStatsPress": "needs its query statistics from the Hub, or computes them on a Hub dataset",
    "KVzapPress": "needs its trained KVzap scorer from the Hub (nvidia/KVzap-*)",
    "FastKVzipPress": "needs its trained gates from the Hub (Jang-Hyun/Fast-KVzip)",
    "RestoreKVPress": "needs its restore embeddings from the Hub",
    "LUKVPress": "needs a published per-model budget curve (kvpress 0.5.5 has one, for Llama-3.1-8B)",
    # not driven by a token budget
    "ThinKPress": "prunes key channels (the head dimension), not tokens: no token budget",
    "SimLayerKVPress": "picks lazy layers by a threshold; its ratio is only known after the forward",
    "DMSPress": "evicts by a score threshold; its ratio is only known after the forward",
    "DecodingPress": "compresses during decoding only, to a token count (target_size), not a budget",
    "CAMPress": "a DecodingPress: compresses during decoding only, to a token count (target_size)",
    "CompressionRatioDecodingPress": "a DecodingPress: compresses during decoding only",
    "PrefillDecodingPress": "its decoding half compresses to a token count (target_size): run it with "
    "explicit press_params (prefilling_press, decoding_press)",
    "ComposedPress": "composes presses given explicitly (press_params.presses)",
    "PerLayerCompressionPress": "needs explicit per-layer ratios (press_params.compression_ratios)",
    # cannot run inside this harness's prefill
    "ObservedAttentionPress": "needs eager attention weights, which the degree-aware attention does not "
    "return (H2O is the native equivalent)",
    "FinchPress": "needs the context/question delimiter token that kvpress's pipeline inserts",
    "KVComposePress": "runs its own extra pass that expects kvpress's pipeline state (fails: no `cache`)",
    "KVgradPress": "runs extra passes on a read-only copy of the cache that the degree-aware attention "
    "cannot read",
}
# Presses that cannot compress during a prefill shared with other presses (`share_prefill`), with the
# reason: they keep a prefill of their own. Every press whose class has its own `__call__` (it does more
# than hook the attention layers of one forward) must be here (tests/test_kvpress_methods.py checks it).
OWN_PREFILL = {
    "KVzipPress": "runs extra forward passes of its own (it reconstructs the context from the cache)",
    "FastKVzipPress": "runs its own gates over the whole forward",
    "FinchPress": "needs the context/question delimiter that kvpress's pipeline inserts into the prompt",
    "KVComposePress": "runs its own extra pass over the prompt",
    "KVgradPress": "runs extra passes on a copy of the cache",
    "RestoreKVPress": "runs an extra restore pass over the cache (a KVzip variant)",
    "PrefillDecodingPress": "its decoding half keeps per-layer state from the prefill to the decoding",
    "DecodingPress": "compresses during decoding only",
    "CAMPress": "compresses during decoding only",
    "CompressionRatioDecodingPress": "compresses during decoding only",
}
# The seed of the global random generator at the start of every press's prefill, so that presses
# that draw random numbers (RandomPress without a seed, LeverageScorePress, CompactorPress) draw the
# same ones whether they share the prefill or not, and from one run to the next.
PRESS_SEED = 0


def import_kvpress():
    """The kvpress module, with our attention wrapped by its head-wise masking patch."""
    try:
        import kvpress
    except ImportError:
        raise ValueError(EXTRA) from None
    from kvpress.attention_patch import attention_patch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from centroidkv.attention import ATTN_IMPLEMENTATION, degree_attention

    # kvpress wraps the attention functions registered when it is imported; ours may come later.
    if ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION) is degree_attention:
        ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] = attention_patch(degree_attention)
    return kvpress


def press_names() -> list[str]:
    """Every concrete press class kvpress exports."""
    kvpress = import_kvpress()
    return sorted(
        name
        for name in kvpress.__all__
        if isinstance(getattr(kvpress, name), type)
        and issubclass(getattr(kvpress, name), kvpress.BasePress)
        and name not in NOT_PRESSES
    )


def short_name(press: str, params: dict[str, Any]) -> str:
    """SnapKVPress -> SnapKV; AdaKVPress around SnapKVPress -> AdaKV(SnapKV)."""
    inner = [params[k] for k in INNER_FIELDS if isinstance(params.get(k), (str, dict))]
    inner_names = [
        short_name(i, {}) if isinstance(i, str) else short_name(i.get("press", "?"), i) for i in inner
    ]
    name = press.removesuffix("Press")
    return f"{name}({', '.join(inner_names)})" if inner_names else name


def construct_press(name: str, params: dict[str, Any], ratio: float):
    """The kvpress press `name` built with `params`; inner presses built from their names."""
    kvpress = import_kvpress()
    if name not in press_names():
        raise ValueError(
            f"kvpress: unknown press {name!r}; choose one of {', '.join(press_names())}"
            + did_you_mean(name, press_names())
        )
    cls = getattr(kvpress, name)
    fields = set(inspect.signature(cls).parameters)  # some presses have their own __init__
    unknown = sorted(set(params) - fields)
    settable = fields - {"compression_ratio"}
    if unknown:
        raise ValueError(
            f"kvpress {name}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(settable))}"
        )
    if "compression_ratio" in params:
        raise ValueError(f"kvpress {name}: compression_ratio is set from the budget (1 - budget); remove it")
    check_param_types(name, cls, params)
    kwargs = dict(params)
    for key in INNER_FIELDS:
        value = kwargs.get(key)
        inner_ratio = 0.0 if key == "base_press" else ratio  # a decoding press sets its own
        if isinstance(value, str):
            kwargs[key] = construct_press(value, {}, inner_ratio)
        elif isinstance(value, dict):
            inner = dict(value)
            kwargs[key] = construct_press(str(inner.pop("press", None)), inner, inner_ratio)
    if "compression_ratio" in fields:
        kwargs["compression_ratio"] = ratio
    try:
        return cls(**kwargs)
    except Exception as error:  # kvpress validates with asserts and its constructors' own errors
        raise ValueError(f"kvpress {name}: {first_line(error)}") from None


def check_param_types(name: str, cls: type, params: dict[str, Any]) -> None:
    """ValueError (one line) for a parameter whose value does not fit its dataclass field's type: bool,
    int, float, str, a Literal, None where Optional, and a press (given by class name or mapping).
    Fields of other types (tensors, lists, ...) are left to the press's own checks."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: nothing to check against
        return
    for key, value in params.items():
        if key in hints and not _fits(value, hints[key]):
            raise ValueError(f"kvpress {name}: {key} must be {_type_name(hints[key])}, got {value!r}")


def _fits(value: Any, annotation: Any) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, import_kvpress().BasePress):
        return isinstance(value, (str, dict))  # an inner press: its class name or a mapping
    return True  # a type this check does not know


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, import_kvpress().BasePress):
        return "a press (its class name, or a mapping with `press`)"
    return getattr(annotation, "__name__", str(annotation))


def build_press(name: str, params: dict[str, Any], ratio: float):
    """The press `name` compressing a fraction `ratio` of the context; ValueError (one line) for a
    bad name or parameter, or for a press that a budget cannot drive."""
    kvpress = import_kvpress()
    press = construct_press(name, params, ratio)
    if isinstance(press, kvpress.PrefillDecodingPress):
        if press.prefilling_press is None:
            raise ValueError(f"kvpress {name}: needs a prefilling_press (it takes the budget)")
        return press
    if isinstance(press, kvpress.DecodingPress):
        raise ValueError(
            f"kvpress {name}: compresses during decoding only, so a budget cannot drive it; "
            "wrap it in PrefillDecodingPress"
        )
    try:
        press.compression_ratio = ratio  # wrappers forward it to their inner press
        driven = press.compression_ratio == ratio
    except Exception:  # no such attribute, a read-only property, or one known only after a forward
        driven = False
    if not driven:
        raise ValueError(
            f"kvpress {name}: its compression is not set by a compression ratio, so a budget cannot drive it"
        )
    return press


def inner_presses(press) -> Iterator[Any]:
    """`press` and every press it wraps (fields press, base_press, prefilling_press, decoding_press, presses)."""
    yield press
    for key in (*INNER_FIELDS, "presses"):
        inner = getattr(press, key, None)
        for one in inner if isinstance(inner, (list, tuple)) else [inner]:
            if one is not None and hasattr(one, "compress"):
                yield from inner_presses(one)


def own_prefill_reason(press) -> str | None:
    """Why `press` cannot share a prefill (`OWN_PREFILL`), or None when it can."""
    base_call = import_kvpress().BasePress.__call__
    for one in inner_presses(press):
        name = type(one).__name__
        if name in OWN_PREFILL:
            return f"{name} {OWN_PREFILL[name]}"
        if type(one).__call__ is not base_call:
            return f"{name} runs more than hooks on one forward (its own __call__)"
    return None


@contextmanager
def seeded_rng(state: list[Tensor] | None = None) -> Iterator[list[Tensor]]:
    """Run a block on the global random generators (CPU, and CUDA when present) seeded with
    PRESS_SEED, or set to `state`; yields a list that holds their state at the end of the block.
    The caller's generators are restored afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    end_state: list[Tensor] = []
    with torch.random.fork_rng(devices=devices):
        if state is None:
            torch.manual_seed(PRESS_SEED)
        else:
            torch.set_rng_state(state[0])
            if devices:
                torch.cuda.set_rng_state_all(state[1:])
        yield end_state
        end_state[:] = [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if devices else [])]


class PressTap:
    """One press's run on a prefill shared with other presses (a sharing `PrefillRun` of
    `centroidkv.plan.prefill_compressor`, i.e. a `centroidkv.plan.decoding.PrefillTap`).

    After each attention layer it runs the press's own forward hook on that layer's call, with the
    fork as the cache: the press reads the layer's full keys and values and leaves its compressed
    ones in the fork, exactly as in a prefill of its own (whose forward never depends on what an
    earlier layer's press did to the cache). The press's random numbers come from its own stream, and
    a head-wise masking press's masks (`masked_key_indices`) are kept per layer for its decoding.
    """

    shares_prefill = True

    def __init__(self, press, model):
        self.press = press
        self.masks: dict[int, Any] = {}  # layer index -> masked_key_indices
        self.rng: list[Tensor] | None = None  # the press's random generator state between layers
        press.post_init_from_model(model)
        language_model = getattr(model.model, "language_model", model.model)
        for module in attention_modules(model):  # as kvpress's own hooks do (some presses read it)
            module.rotary_emb = language_model.rotary_emb

    def after_layer(self, module, kwargs: dict, output, cache) -> None:
        module.masked_key_indices = None
        try:
            with seeded_rng(self.rng) as end_state:
                self.press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
            self.rng = end_state
            if module.masked_key_indices is not None:
                self.masks[module.layer_idx] = module.masked_key_indices
        finally:
            module.masked_key_indices = None  # the next press, and the shared forward, see no mask

    def prefill_hooks(self, model) -> AbstractContextManager:
        raise RuntimeError("a press tap compresses inside a shared prefill (after_layer), not its own")

    @property
    def decodes_alone(self) -> bool:
        return bool(self.masks)

    @contextmanager
    def decoding_hooks(self, model) -> Iterator[None]:
        """The press's masks on their layers while its fork decodes (no-op for a press that shrinks)."""
        modules = attention_modules(model)
        try:
            for module in modules:
                module.masked_key_indices = self.masks.get(module.layer_idx)
            yield
        finally:
            for module in modules:
                module.masked_key_indices = None

    def record_fields(self) -> dict[str, Any]:
        return {"kv_masked": bool(self.masks)}


class OwnPrefillPress:
    """One press's run with a prefill of its own (a `centroidkv.plan.prefill_compressor.PrefillRun`):
    kvpress's own way, its context manager around the whole prefill forward. A `PrefillDecodingPress`
    stays active while the run decodes (its decoding half compresses then). Always decoded alone."""

    shares_prefill = False
    decodes_alone = True

    def __init__(self, press):
        self.press = press
        self.masked = False  # set when the prefill ends: whether the press masked instead of shrinking

    def after_layer(self, module, kwargs: dict, output, cache) -> None:
        raise RuntimeError("this press runs with a prefill of its own (prefill_hooks)")

    @contextmanager
    def prefill_hooks(self, model) -> Iterator[None]:
        modules = attention_modules(model)
        for module in modules:
            module.masked_key_indices = None
        attn_implementation = model.config._attn_implementation
        try:
            with seeded_rng(), self.press(model):
                yield
        finally:  # some presses switch the attention for a pass (KVComposePress): never leave it so
            model.config._attn_implementation = attn_implementation
        self.masked = any(getattr(m, "masked_key_indices", None) is not None for m in modules)

    @contextmanager
    def decoding_hooks(self, model) -> Iterator[None]:
        kvpress = import_kvpress()
        try:
            if isinstance(self.press, kvpress.PrefillDecodingPress):
                with self.press(model):
                    yield
            else:
                yield
        finally:  # the masks belong to this run's cache: never let them reach the next one
            for module in attention_modules(model):
                module.masked_key_indices = None

    def record_fields(self) -> dict[str, Any]:
        return {"kv_masked": self.masked}


def ratio_for(budget: float, context_len: int, max_new_tokens: int) -> float:
    """kvpress's compression ratio that keeps B = int(budget * (n + Gamma)) of n context tokens."""
    kept = min(context_len, budget_entries(budget, context_len, max_new_tokens))
    # kvpress keeps int(n * (1 - ratio)); aim half an entry above B so rounding cannot lose one.
    return max(0.0, 1.0 - (kept + 0.5) / context_len) if kept < context_len else 0.0


@register
@dataclass
class KVPress(Method):
    name = "kvpress"
    label = "kvpress"
    shorthand = "press"  # `kvpress:SnapKVPress` on a command line is press=SnapKVPress

    press: str = "SnapKVPress"
    press_params: dict[str, Any] = field(default_factory=dict)
    wrapper_params = {  # no head policy, the model's dtype: a press compresses in kvpress's own hooks
        "heads": param(
            "none",
            choices=("none",),
            reason="presses compress inside kvpress's own hooks, which apply no head policy; "
            "native methods take heads=whole|budget",
        ),
        "kv_precision": param(
            "model",
            choices=("model",),
            reason="kv_precision needs the harness's own cache; a press stores the model's dtype",
        ),
    }

    @classmethod
    def rules(cls) -> dict[str, dict[str, Any]]:
        """The fields' rules, and the press names kvpress exports as `press`'s choices (recorded in the
        configuration's schema, so a mistyped press is one line before torch loads)."""
        rules = super().rules()
        with suppress(ValueError):  # kvpress is not installed: building the press says so (EXTRA)
            rules["press"] = {**rules["press"], "choices": press_names()}
        return rules

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.press, str):  # its field's rule takes a path too (centroidkv.params)
            raise ValueError(f"{self.name}: press must be a kvpress class name, got {self.press!r}")
        self.press_params = dict(self.press_params)
        build_press(self.press, self.press_params, 0.5)  # every bad name or value fails here, before a run

    @classmethod
    def label_for(cls, params: dict[str, Any]) -> str:
        press = params.get("press") or cls.__dataclass_fields__["press"].default
        return f"{short_name(press, dict(params.get('press_params') or {}))} (kvpress)"

    @classmethod
    def variant_for(cls, params: dict[str, Any]) -> str:
        """kvpress-<press>, e.g. kvpress-TOVA, kvpress-AdaKV-SnapKV: one job can hold many presses."""
        press = params.get("press") or cls.__dataclass_fields__["press"].default
        name = short_name(press, dict(params.get("press_params") or {}))
        return re.sub(r"[^A-Za-z0-9_.+-]+", "-", f"kvpress-{name}").strip("-")

    def compress(self, kv: LayerKV, target_len: int, stats: LayerStats) -> LayerKV:
        raise RuntimeError("kvpress presses compress inside a prefill forward (prefill_run), not here")

    def prefill_run(
        self, model, budget: float, context_len: int, max_new_tokens: int, share_prefill: bool
    ) -> PressTap | OwnPrefillPress:
        """This press's run on one prompt (a `PrefillCompressor`, `centroidkv.plan.prefill_compressor`): a
        tap of the shared prefill when it may share it, else its own prefill (`OWN_PREFILL`)."""
        press = build_press(self.press, self.press_params, ratio_for(budget, context_len, max_new_tokens))
        if share_prefill and not own_prefill_reason(press):
            return PressTap(press, model)
        return OwnPrefillPress(press)


def main(argv: list[str] | None = None) -> int:
    """`python -m baselines.kvpress_press skips`: one line per press the zoo skips, with the reason."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args != ["skips"]:
        print("usage: python -m baselines.kvpress_press skips", file=sys.stderr)
        return 2
    try:
        names = press_names()
    except ValueError as error:
        print(f"[skip] every kvpress press: {error}", file=sys.stderr)
        return 0
    for name in names:
        if name in ZOO_SKIPS:
            print(f"[skip] kvpress {name}: {ZOO_SKIPS[name]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
