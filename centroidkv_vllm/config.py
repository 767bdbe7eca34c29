"""The plugin's settings, read from vLLM's `additional_config["centroidkv"]`, and what it refuses.

Budgets follow the harness (`centroidkv.cache.budget`, in entries): each request keeps B = R * (n + Gamma)
entries per layer and KV head, n its prompt length and Gamma `max_new_tokens` (with `heads="whole"`
the calibrated heads keep every token and B is solved in bytes over both parts, as the harness's
default CentroidKV does: `centroidkv_vllm.heads`); it is compressed to B
once the whole prompt is in (when n > B) and again whenever it has grown to B + g (g =
`compress_interval`). The first `n_sink` and last `n_recent` entries are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from centroidkv.cache.budget import check_budget
from centroidkv.errors import first_line
from centroidkv.params import field_rules, param, param_errors

if TYPE_CHECKING:
    from centroidkv.wrapper import MethodWrapper

CONFIG_KEY = "centroidkv"
SUPPORTED_ISAS = ("vec", "vec16")  # the CPU kernels whose block layout `centroidkv_vllm.paged` reads
MAX_COUNT = 2**31 - 1  # every count setting (tokens, entries) fits vLLM's int32 positions


class SettingsError(ValueError):
    """A setting of the plugin that is unknown, of the wrong type or out of range (one line)."""


@dataclass(frozen=True)
class CentroidConfig:
    """budget: R in (0, 1]; max_new_tokens: Gamma of the budget's reference n + Gamma; the rest are the
    `CentroidKV` method's parameters (`centroidkv/centroidkv.py`), with its defaults."""

    budget: float = 1.0
    max_new_tokens: int = param(256, minimum=0)
    compress_interval: int = 64
    n_sink: int = 16
    n_recent: int = 64
    chunk_size: int = 256
    schedule: str = "adaptive"
    r_min: float = 0.1
    # the head policy (centroidkv.head_policy): "none" compresses every KV head, budgets in entries;
    # "whole" keeps the heads the head file lists whole (every token, in a per-request side store,
    # centroidkv_vllm.heads) and solves the other heads' B from a byte budget over both parts
    heads: str = param("none", choices=("none", "whole"))
    heads_file: str = "clustering"  # a score of the model's calibration, or a head file's path
    heads_fraction: float = param(0.04, minimum=0.0, maximum=1.0)  # the worst fraction listed
    # every decoding row through the plugin's float32 attention, not only those holding centroids:
    # a reference for benchmarks (at R = 1, the full cache through the plugin's own attention)
    own_attention: bool = False
    # decoding rows of a bf16 cache through the C++ loop (centroidkv_vllm.compiled); False: PyTorch's
    compiled_attention: bool = True

    @classmethod
    def rules(cls) -> dict[str, dict[str, Any]]:
        """Each setting's rule (`centroidkv.params`): the CentroidKV method's own for its parameters,
        the type of the default for the others (a bool is a bool, an int an int, never a string),
        every count at most MAX_COUNT; `heads` is the plugin's own (none or whole)."""
        from centroidkv.centroidkv import CentroidKV  # torch: at call time

        method_rules = CentroidKV.rules()
        own = ("heads",)  # the plugin serves two of the head policies (no "budget")
        rules = {
            name: rule if name in own else method_rules.get(name, rule)
            for name, rule in field_rules(cls).items()
        }
        for rule in rules.values():
            if rule.get("type") == "int" and "maximum" not in rule:
                rule["maximum"] = MAX_COUNT
        return rules

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> CentroidConfig:
        """The settings checked (SettingsError, one line: an unknown name, a value of the wrong type
        or out of range), then the config."""
        if not isinstance(settings, dict):
            raise SettingsError(f"centroidkv: the settings must be a mapping, got {settings!r}")
        problems = param_errors("centroidkv", settings, cls.rules())
        if problems:
            raise SettingsError(problems[0])
        try:
            check_budget(settings.get("budget", cls.budget))
        except ValueError as error:
            raise SettingsError(f"centroidkv: {error}") from None
        config = cls(**settings)
        try:  # the method checks what binds one parameter by another (r_min <= its r_init)
            config.method()
        except ValueError as error:
            raise SettingsError(first_line(error)) from None  # its line starts "centroidkv: "
        return config

    def method(self) -> MethodWrapper:
        """The harness's CentroidKV with these settings (`get_method`, inside its wrappers): the head
        policy `heads` (none or whole) and similarity on the cached (post-RoPE) keys."""
        from centroidkv.methods import get_method  # torch: at call time

        return get_method(
            "centroidkv",
            chunk_size=self.chunk_size,
            schedule=self.schedule,
            r_min=self.r_min,
            similarity="post_rope",
            heads=self.heads,
            heads_file=self.heads_file,
            heads_fraction=self.heads_fraction,
            n_sink=self.n_sink,
            n_recent=self.n_recent,
            compress_interval=self.compress_interval,
        )

    @property
    def budget_unit(self) -> str:
        """The harness's `budget_unit` this config runs: "bytes" over both parts with heads kept whole,
        else "entries" (B = R (n + Gamma) for every head)."""
        return "bytes" if self.heads == "whole" else "entries"


def config_of(vllm_config: Any) -> CentroidConfig | None:
    """The plugin's settings for this engine, None when it is not configured (stock behaviour)."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return None
    return CentroidConfig.from_dict(extra[CONFIG_KEY])


def refusal(vllm_config: Any, isa: str, sliding_window: int) -> str | None:
    """One line naming the first vLLM feature this engine uses that the plugin does not support."""
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        return "centroidkv: prefix caching is not supported (merged blocks are rewritten); pass enable_prefix_caching=False"
    if vllm_config.speculative_config is not None:
        return "centroidkv: speculative decoding is not supported (a draft's entries would be merged)"
    if str(cache.cache_dtype) != "auto":
        return f"centroidkv: kv_cache_dtype={cache.cache_dtype} is not supported; use the model's dtype"
    if isa not in SUPPORTED_ISAS:
        return f"centroidkv: the CPU attention ISA {isa!r} is not supported (block layout of {SUPPORTED_ISAS} only)"
    if sliding_window > 0:
        return "centroidkv: sliding-window attention is not supported"
    return None
