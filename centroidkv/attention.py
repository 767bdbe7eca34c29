"""Degree-aware attention, registered with transformers' attention-function interface.

A cached entry of degree n stands for n original tokens, so its logit gets + log n:
softmax(q k^T / sqrt(d) + log n). For n exact duplicates this is exact: one entry with weight n
equals n identical entries. With all degrees 1 the function is plain causal SDPA.

The function reaches its cache layer through `module.kv_layer` (and the cache's settings it hands
the layer, `module.kv_planner`), set before every attention call by a forward pre-hook that reads
the `past_key_values` argument (no model forward is copied or patched).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from centroidkv.cache.cache import CompressedCache, CompressedLayer, causal_allowed
from centroidkv.cache.fork_batch import ForkBatch, ForkBatchLayer
from centroidkv.cache.planner import GroupPlanner
from centroidkv.cache.window_layer import sliding_windows, window_attention
from centroidkv.flex import fused_attention

ATTN_IMPLEMENTATION = "centroidkv"


def degree_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [B, Hq, q, D], key/value [B, Hkv, T, D] -> output [B, q, Hq, D].

    The q new tokens are the last q entries of the cache, so the causal mask is aligned to the
    bottom-right corner (physical lengths differ from positions once the cache is compressed).
    When the layer's head policy split its KV heads into groups (`centroidkv.cache.head_group`),
    `key`/`value` hold the main group's heads only and the others are read from the layer: each
    group runs its own attention, a query head with the group of its KV head, and each group's records
    (windows, accumulated attention) see only its own query heads. Under a `ForkBatch` (forks of one prefill
    decoded together) row f runs against fork f's own layer.
    A hybrid model's window layer (`sliding_window` given) attends over its last W positions
    (`centroidkv.cache.window_layer`). The argument order is transformers' own (`dropout` before `scaling`):
    wrappers from other libraries pass them positionally.
    """
    if attention_mask is not None:
        raise NotImplementedError(
            "centroidkv attention builds its own causal mask; custom masks are not supported"
        )
    layer, planner = getattr(module, "kv_layer", None), getattr(module, "kv_planner", None)
    window = kwargs.get("sliding_window")
    if isinstance(layer, ForkBatchLayer):  # forks decoded together: each row with its own fork's entries
        rows = [
            layer_attention(
                query[row : row + 1],
                fork.read("keys"),
                fork.read("values"),
                fork,
                planner,
                scaling,
                dropout,
                window,
            )
            for row, (fork, planner) in enumerate(zip(layer.forks, layer.planners(), strict=True))
        ]
        return torch.cat(rows), None
    return layer_attention(query, key, value, layer, planner, scaling, dropout, window), None


def layer_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layer: CompressedLayer | None,
    planner: GroupPlanner | None,
    scaling: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> Tensor:
    """`degree_attention` against one cache layer (None: plain causal attention) -> [B, q, Hq, D];
    `planner`: the layer's cache's settings (`CompressedCache.planner`), handed to the layer after."""
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    if sliding_window is not None:  # a hybrid model's window layer: never compressed, degrees all 1
        if layer is not None and layer.compresses:
            raise RuntimeError(f"layer {layer.layer_idx} has a sliding window but its cache compresses it")
        output = window_attention(query, key, value, sliding_window, scaling)
        if layer is not None:
            layer.after_attention(planner, query, scale)
        return output
    if layer is None:
        return _group_attention(query, key, value, None, scaling, scale, dropout, False)[0]
    if not layer.is_split():
        main = layer.main
        output, received = _group_attention(
            query, key, value, main.log_degree, scaling, scale, dropout, main.tracks_attention
        )
        layer.after_attention(planner, query, scale, received)
        return output
    output, queries, received = _split_attention(query, key, value, layer, scaling, scale, dropout)
    layer.after_attention(planner, queries, scale, received)
    return output


def _split_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layer: CompressedLayer,
    scaling: float | None,
    scale: float,
    dropout: float,
) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
    """A layer whose heads are split in groups (`centroidkv.cache.head_group`): each group runs its own
    attention, a query head with the group of its KV head; `key`/`value` are the main group's.
    Returns the output, and each group's queries and the attention its entries received."""
    groups = layer.groups
    group_size = query.shape[1] // sum(len(group.heads) for group in groups)
    by_kv_head = query.unflatten(1, (-1, group_size))  # [B, Hkv, group, q, D]
    queries = [by_kv_head[:, group.heads].flatten(1, 2) for group in groups]
    outputs, received = [], []
    for group, group_query in zip(groups, queries, strict=True):
        keys, values = (key, value) if group is layer.main else (group.read("keys"), group.read("values"))
        output, got = _group_attention(
            group_query, keys, values, group.log_degree, scaling, scale, dropout, group.tracks_attention
        )
        outputs.append(output.unflatten(2, (-1, group_size)))
        received.append(got)
    # back to the model's head order: KV head h's query heads are rows h * group .. h * group + group - 1
    order = torch.cat([group.heads for group in groups]).argsort()
    return torch.cat(outputs, dim=2)[:, :, order].flatten(2, 3), queries, received


def _group_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_degree: Tensor | None,
    scaling: float | None,
    scale: float,
    dropout: float,
    tracks: bool,
) -> tuple[Tensor, Tensor | None]:
    """One group of heads -> (output [B, q, Hq, D], received [B, Hkv, T] or None)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if query.shape[1] == 0:  # every head of the layer is in the other group
        return query.new_empty(query.shape[0], q_len, 0, query.shape[3]), None
    group = query.shape[1] // key.shape[1]
    if tracks:
        # H2O-style methods need the attention every entry receives: one pass computes both.
        if dropout:
            raise NotImplementedError("accumulating attention needs dropout 0 (inference)")
        if log_degree is None and q_len == kv_len and query.device.type == "cpu":
            return prefill_with_received(query, key, value, scale)
        output, received = attention_with_received(query, key, value, log_degree, scale)
        return output.transpose(1, 2).contiguous(), received
    if (fused := fused_attention(query, key, value, log_degree, scale, dropout)) is not None:
        return fused, None  # FlexAttention / flash-attn on CUDA (centroidkv.flex)
    if log_degree is None and (q_len == 1 or q_len == kv_len):
        # All degrees 1 and no offset between queries and keys: SDPA's own causal / GQA path.
        output = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=q_len > 1, scale=scaling, enable_gqa=group > 1
        )
        return output.transpose(1, 2).contiguous(), None
    return _biased_attention(query, key, value, log_degree, scaling, dropout), None


def attention_with_received(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_degree: Tensor | None,
    scaling: float,
    block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention that also returns the attention each cached entry receives.

    query [B, Hq, q, D] (the last q cached tokens), keys/values [B, H_kv, T, D] ->
    (output [B, Hq, q, D] in the query's dtype, received [B, H_kv, T] float32: attention
    probabilities summed over the q queries and the query heads of each KV head).

    Queries go in blocks of `block` rows, and each block only meets the keys it can see (the causal
    triangle is skipped, not masked), so q x T logits are never materialised at once. Small blocks
    keep a block's logits in the CPU's cache, which is what makes this pass cheap there.
    """
    batch, kv_heads, length, head_dim = keys.shape
    q_heads, q_len = query.shape[1], query.shape[2]
    group = q_heads // kv_heads
    if block is None:  # 128 query rows on a CPU, ~8M logits per block on an accelerator
        block = 128 if keys.device.type == "cpu" else max(128, 2**23 // (q_heads * length))
    offset = length - q_len  # cached tokens before the first query
    keys_t, values_f = keys.float().transpose(-1, -2), values.float()
    grouped = query.float().reshape(batch, kv_heads, group, q_len, head_dim) * scaling
    output = values_f.new_empty(batch, kv_heads, group, q_len, head_dim)
    received = values_f.new_zeros(batch, kv_heads, length)
    for start in range(0, q_len, block):
        rows = min(block, q_len - start)
        visible = offset + start + rows  # keys the block's last query may see
        logits = grouped[:, :, :, start : start + rows].reshape(batch, kv_heads, group * rows, head_dim)
        logits = logits @ keys_t[..., :visible]  # rows ordered (group, query)
        if log_degree is not None:
            logits += log_degree[:, :, None, :visible]
        if rows > 1:  # inside the block's own diagonal square, query i sees keys up to i
            future = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu(1)
            logits.view(batch, kv_heads, group, rows, visible)[..., visible - rows :].masked_fill_(
                future, float("-inf")
            )
        probabilities = logits.softmax(dim=-1)
        received[..., :visible] += probabilities.sum(dim=2)
        block_output = probabilities @ values_f[:, :, :visible]
        output[:, :, :, start : start + rows] = block_output.view(batch, kv_heads, group, rows, head_dim)
    return output.view(batch, q_heads, q_len, head_dim).to(query.dtype), received


def prefill_with_received(
    query: Tensor, keys: Tensor, values: Tensor, scaling: float
) -> tuple[Tensor, Tensor]:
    """A prefill's causal attention (queries = keys, all degrees 1) and the attention each key receives,
    on a CPU: query [B, Hq, L, D], keys/values [B, Hkv, L, D] -> (output [B, L, Hq, D], received
    [B, Hkv, L] float32), as `attention_with_received` computes them, at about 1.5 times the cost of
    the attention alone instead of five times (docs/speed.md).

    The output is SDPA's causal kernel (the plain prefill's, bit for bit), which also returns each
    query row's log-sum-exp (lse); `received_attention` then needs only the logits once more.
    """
    group = query.shape[1] // keys.shape[1]
    per_query_head = [t.repeat_interleave(group, dim=1) if group > 1 else t for t in (keys, values)]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    output, lse = flash(query, *per_query_head, 0.0, True, scale=scaling)[:2]
    return output.transpose(1, 2).contiguous(), received_attention(query, keys, lse, scaling)


RECEIVED_KERNEL = "logit-tiles-exp2"  # in a stored prefill's key: another kernel, other last bits
LOG2_E = 1.4426950408889634
RECEIVED_TILE = (128, 512)  # (queries, keys) per tile: a tile's logits stay in the CPU's cache


def received_attention(
    query: Tensor, keys: Tensor, lse: Tensor, scaling: float, tile: tuple[int, int] = RECEIVED_TILE
) -> Tensor:
    """What each key receives in a causal attention whose rows' log-sum-exp `lse` [B, Hq, L] is known:
    received[k] = sum over the queries q >= k and the query heads of k's KV head of exp(s q.k - lse_q),
    float32 [B, Hkv, L]. Query [B, Hq, L, D], keys [B, Hkv, L, D].

    Tiles of (queries, keys) below the diagonal: one matmul with -lse as its bias, exp, a column sum.
    Only the logits are computed (half an attention's FLOPs), never the probabilities times values,
    and since s q.k <= lse_q every exponential is at most 1 (no running maximum is needed). The logits
    are in base 2 (scaled by log2 e): torch's exp2 is several times faster than its exp on a CPU, most
    of all on the far negative logits of long prompts, whose exp underflows on a slow path.
    """
    batch, kv_heads, length, head_dim = keys.shape
    group, (tile_rows, tile_cols) = query.shape[1] // kv_heads, tile
    heads = batch * kv_heads  # the matmuls' batch: one per KV head, its query heads' rows stacked
    scaled = (query.float() * (scaling * LOG2_E)).reshape(heads, group, length, head_dim)
    minus_lse = (lse.float() * -LOG2_E).reshape(heads, group, length, 1)
    keys_t = keys.float().reshape(heads, length, head_dim).transpose(1, 2)
    received = keys_t.new_zeros(heads, length)
    logits_buffer = keys_t.new_empty(heads * group * tile_rows * tile_cols)
    positions = torch.arange(length, device=keys.device)
    for first in range(0, length, tile_rows):
        last = min(first + tile_rows, length)
        rows = scaled[:, :, first:last].reshape(heads, -1, head_dim)
        bias = minus_lse[:, :, first:last].reshape(heads, -1, 1)
        for start in range(0, last, tile_cols):
            stop = min(start + tile_cols, last)
            logits = logits_buffer[: rows.shape[1] * (stop - start) * heads].view(heads, -1, stop - start)
            torch.baddbmm(bias, rows, keys_t[:, :, start:stop], out=logits)
            if stop > first:  # the diagonal: query i sees keys up to i
                future = positions[start:stop] > positions[first:last, None]
                logits.view(heads, group, last - first, -1).masked_fill_(future, float("-inf"))
            received[:, start:stop] += logits.exp2_().sum(dim=1)
    return received.view(batch, kv_heads, length)


def _biased_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    log_degree: Tensor | None,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """SDPA with an additive bias: + log_degree, and a bottom-right causal mask when q > 1."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    # An additive bias rules out SDPA's GQA path; rather than copying keys to every query head,
    # fold each KV head's query heads into its rows: [B, Hkv, group * q, D], rows ordered (group, q).
    grouped_query = query.reshape(batch, kv_heads, group * q_len, head_dim)
    bias = None
    if log_degree is not None:
        bias = log_degree.to(query.dtype).unsqueeze(2)  # [B, Hkv, 1, T], broadcast over the rows
    if q_len > 1:
        allowed = causal_allowed(q_len, kv_len, query.device).repeat(group, 1)
        causal = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        causal.masked_fill_(~allowed, torch.finfo(query.dtype).min)
        bias = causal if bias is None else bias + causal
    output = F.scaled_dot_product_attention(
        grouped_query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).contiguous()


def no_padding_mask(*, attention_mask: Tensor | None = None, **kwargs) -> None:
    """Mask function for our implementation: the attention builds the causal mask itself.

    A padding mask cannot be honoured once entries are merged (columns no longer map to tokens), so
    padded batches are refused instead of silently mis-masked.
    """
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "padded batches are not supported: use equal-length prompts or batch size 1"
        )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, degree_attention)
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_padding_mask)


def _bind_cache_layer(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    model_ref: weakref.ref,
    rotary: list | None,
    windows: dict[int, int],
) -> None:
    # transformers 5.2 passes the cache as `past_key_values`; later versions may name it differently.
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if isinstance(cache, CompressedCache) and module.config._attn_implementation == ATTN_IMPLEMENTATION:
        _tell_cache(cache, module.config, model_ref, rotary, windows)
        module.kv_layer, module.kv_planner = cache.layer(module.layer_idx), cache.planner()
    elif isinstance(cache, ForkBatch) and module.config._attn_implementation == ATTN_IMPLEMENTATION:
        module.kv_layer = cache.layers[module.layer_idx]  # its forks were bound when they were prefilled
        module.kv_planner = None  # each fork's own: `ForkBatchLayer.planners`
    else:
        module.kv_layer = module.kv_planner = None


def _tell_cache(
    cache: CompressedCache, config, model_ref: weakref.ref, rotary: list | None, windows: dict[int, int]
) -> None:
    """What a cache reads about its model (`CompressedCache.take_model_from` copies it to another)."""
    cache.n_layers = config.num_hidden_layers
    cache.rotary, cache.model_ref, cache.sliding_windows = rotary, model_ref, windows
    cache.query_group = config.num_attention_heads // config.num_key_value_heads


def bind_model(cache: CompressedCache, model: PreTrainedModel) -> None:
    """Tell `cache` about a prepared `model` as its first attention call would: for a cache built
    without a forward of that model (a prefill read back from disk, `centroidkv.plan.prefill_store`)."""
    config = attention_modules(model)[0].config  # a multimodal model's text configuration
    rotary = layer_rotaries(model, config.num_hidden_layers, getattr(config, "layer_types", None))
    _tell_cache(cache, config, weakref.ref(model), rotary, sliding_windows(config))


def _unbind_cache_layer(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
    module.kv_layer = module.kv_planner = None  # the model must not keep the last cache alive


def rotary_embedding(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (the one computing cos/sin from position ids), if any."""
    found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    return found[0] if found else None


class LayerTypeRotary:
    """The rotary table of one layer type in a module that holds one per type (Gemma 3's
    `<type>_inv_freq` buffers), read when asked so that it follows the module across devices."""

    def __init__(self, module: nn.Module, layer_type: str):
        self.module, self.layer_type = module, layer_type

    @property
    def inv_freq(self) -> Tensor:
        return getattr(self.module, f"{self.layer_type}_inv_freq")


def layer_rotaries(model: nn.Module, n_layers: int, layer_types: list[str] | None) -> list | None:
    """Each layer's rotary table (an object with `inv_freq`): the model's one table, or the table of
    the layer's type when the rotary module holds one per type; None for a model without rotary."""
    module = rotary_embedding(model)
    if module is None:
        return None
    if hasattr(module, "inv_freq"):
        return [module] * n_layers
    if not layer_types or not all(hasattr(module, f"{kind}_inv_freq") for kind in layer_types):
        return None
    return [LayerTypeRotary(module, kind) for kind in layer_types]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules (those with a `layer_idx` and an output projection), in layer order."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]


def prepare_model(model: PreTrainedModel, name: str | None = None) -> PreTrainedModel:
    """Switch a loaded model to degree-aware attention and hook its attention modules (idempotent).

    `name` (e.g. "smollm2-135m") identifies the model for per-model data such as CentroidKV's
    calibrated outlier heads; it defaults to the config's `name_or_path`.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if name is not None or not hasattr(model, "centroidkv_name"):
        model.centroidkv_name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
    if getattr(model, "_centroidkv_prepared", False):
        return model
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__}: no attention modules with a layer_idx were found")
    config = modules[0].config  # a multimodal model's text configuration
    rotary = layer_rotaries(model, config.num_hidden_layers, getattr(config, "layer_types", None))
    bind = functools.partial(
        _bind_cache_layer, model_ref=weakref.ref(model), rotary=rotary, windows=sliding_windows(config)
    )
    for module in modules:
        module.register_forward_pre_hook(bind, with_kwargs=True)
        module.register_forward_hook(_unbind_cache_layer, with_kwargs=True)
    model._centroidkv_prepared = True
    return model
