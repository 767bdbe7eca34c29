"""Storage precision of the KV cache: 16-bit floats, or KIVI-style integer codes really packed.

Paper: Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024 (arXiv 2402.02750). Keys have outlier *channels*, so they are
quantized per channel (each channel of a group of `group` consecutive tokens gets its own scale and
zero); values have no channel structure and are quantized per token (each token's channels in groups of
`group`). The most recent tokens stay in full precision (the residual), and are quantized a whole group
at a time as they leave it.

Formats (`PRECISIONS`):
  model        the model's dtype, nothing converted (today's cache);
  bf16, fp16   the entries stored in that 16-bit float dtype;
  int8/4/2     asymmetric min-max codes of 8/4/2 bits, packed along the head dimension (one, two or
               four codes per uint8), with a float16 scale and zero per group (`SCALE_DTYPE`), and a
               residual of the last `residual` .. `residual + group - 1` entries in the model's dtype.

Error bound (`error_bound`): a dequantized element is within scale / 2 of the original, plus the
float16 rounding of its group's zero (the zero is rounded down and the scale up, so no code is clipped
except by that rounding).

Why not optimum-quanto or HQQ (docs/design.md, "Storage precision"): transformers' `QuantizedCache`
layers take nbits 2 or 4 only (no int8), quantize along axis 0 or -1 of the [B, H, T, D] tensor (KIVI's
per-channel keys group along T), and re-quantize the whole cache each time the residual fills; quanto
keeps scales in the input dtype and HQQ optimises its zero points iteratively. The cache here also
re-quantizes after every merge or eviction and must count every stored byte, so the quantizer is these
few vectorised functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from centroidkv.params import check_param

PRECISIONS = ("model", "bf16", "fp16", "int8", "int4", "int2")
FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INTEGER_BITS = {"int8": 8, "int4": 4, "int2": 2}
SCALE_DTYPE = torch.float16  # scales and zeros, as KIVI stores them
DEFAULT_GROUP = 32  # KIVI's group size in its main experiments
DEFAULT_RESIDUAL = 128  # KIVI's full-precision residual
CODE_AXES = ("channel", "token")  # keys per channel, values per token


# The storage parameters' rules (`centroidkv.params.param`), declared once: the fields of the storage
# precision (`centroidkv.storage_precision`) carry them into the torch-free schema, and
# `check_precision` checks a format built without a method.
# A group divides the head size (no model here has heads over 256 channels); the residual is a
# preallocated full-precision buffer, so it is bounded by the longest context any model here takes.
MAX_GROUP = 256
MAX_RESIDUAL = 131072
GROUP_RULE = {"minimum": 1, "maximum": MAX_GROUP, "power_of_two": True, "reason": "it divides the head size"}
RESIDUAL_RULE = {"minimum": 0, "maximum": MAX_RESIDUAL, "reason": "tokens kept in full precision"}


def check_precision(precision: object, group: object, residual: object, where: str) -> None:
    """Raise one ValueError line for a storage format that cannot be built (`where`: who asks)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: kv_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for name, value, rule in (("kv_group", group, GROUP_RULE), ("kv_residual", residual, RESIDUAL_RULE)):
        check_param(where, name, value, {"type": "int", **rule})


@dataclass(frozen=True)
class StorageFormat:
    """How a cache stores its keys and values (module docstring)."""

    precision: str = "model"
    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL

    def __post_init__(self) -> None:
        check_precision(self.precision, self.group, self.residual, "storage")

    @property
    def bits(self) -> int | None:
        return INTEGER_BITS.get(self.precision)

    @property
    def integer(self) -> bool:
        return self.precision in INTEGER_BITS

    @property
    def float_dtype(self) -> torch.dtype | None:
        return FLOAT_DTYPES.get(self.precision)

    @property
    def suffix(self) -> str:
        """What a label adds (" @int8"); nothing for the model's dtype."""
        return "" if self.precision == "model" else f" @{self.precision}"

    def quantized_length(self, length: int) -> int:
        """Entries of `length` that are stored as codes: whole groups, leaving at least `residual`."""
        if not self.integer or length < self.residual + self.group:
            return 0
        return (length - self.residual) // self.group * self.group

    def entries_in(self, model_entries: int, model_itemsize: int) -> int:
        """About how many entries per head this format stores in the bytes of `model_entries` entries
        in the model's dtype (codes, their scales and zeros, and the residual window in the model's
        dtype; head dims at least the group). An estimate for checks made before a model loads."""
        if not self.integer:
            itemsize = self.float_dtype.itemsize if self.float_dtype is not None else model_itemsize
            return int(model_entries * model_itemsize / itemsize)
        if model_entries <= self.residual:
            return model_entries
        per_element = self.bits / 8 + 2 * SCALE_DTYPE.itemsize / self.group  # codes, scale and zero shares
        return int(self.residual + (model_entries - self.residual) * model_itemsize / per_element)

    def entry_bytes(self, head_dim: int, model_itemsize: int, quantized: bool) -> float:
        """Bytes of one entry (a key and a value of one head): as codes with their share of the
        scales and zeros when `quantized`, else in the storage's float dtype."""
        if not (self.integer and quantized):
            itemsize = self.float_dtype.itemsize if self.float_dtype is not None else model_itemsize
            return 2 * head_dim * itemsize
        codes = head_dim * self.bits / 8
        value_group = min(self.group, head_dim)
        per_group = 2 * SCALE_DTYPE.itemsize  # a scale and a zero
        key_records = head_dim * per_group / self.group  # per channel, shared by `group` tokens
        value_records = head_dim / value_group * per_group  # per token, one pair per channel group
        return 2 * codes + key_records + value_records


@dataclass
class PackedCodes:
    """Quantized entries of one [B, H, T, D] tensor (T a multiple of `group` for keys).

    codes  [B, H, T, D * bits / 8] uint8, packed along the head dimension
    scale, zero  float16: [B, H, T / group, D] per channel (keys) or [B, H, T, D / group] per token
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    bits: int
    group: int
    axis: str

    @property
    def length(self) -> int:
        return self.codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[3] * 8 // self.bits

    def tensors(self) -> list[Tensor]:
        return [self.codes, self.scale, self.zero]

    def map(self, fn) -> PackedCodes:
        """Apply `fn` to every tensor (a batch index or reorder along dim 0)."""
        return PackedCodes(fn(self.codes), fn(self.scale), fn(self.zero), self.bits, self.group, self.axis)

    def heads(self, index: Tensor) -> PackedCodes:
        return self.map(lambda t: t[:, index])


def _grouped(x: Tensor, group: int, axis: str) -> Tensor:
    """[B, H, T, D] -> [B, H, T / g, g, D] (per channel: a group of tokens) or [B, H, T, D / g, g]."""
    batch, heads, length, head_dim = x.shape
    if axis == "channel":
        return x.view(batch, heads, length // group, group, head_dim)
    return x.view(batch, heads, length, head_dim // group, group)


def _ungrouped(x: Tensor, axis: str) -> Tensor:
    """Inverse of `_grouped`: back to [B, H, T, D]."""
    return x.flatten(2, 3) if axis == "channel" else x.flatten(3, 4)


def value_group(group: int, head_dim: int) -> int:
    """Channels per value group: `group`, or the whole head when it is smaller."""
    return min(group, head_dim)


def quantize(x: Tensor, bits: int, group: int, axis: str) -> PackedCodes:
    """Asymmetric min-max codes of `x` [B, H, T, D], packed (KIVI's layout; module docstring)."""
    if axis not in CODE_AXES:
        raise ValueError(f"axis must be one of {', '.join(CODE_AXES)}, got {axis!r}")
    head_dim = x.shape[-1]
    group_size = group if axis == "channel" else value_group(group, head_dim)
    if (axis == "channel" and x.shape[2] % group_size) or head_dim % value_group(group, head_dim):
        raise ValueError(
            f"cannot quantize {tuple(x.shape)} in groups of {group}: the head size must be a multiple of "
            "the group (or smaller than it) and keys come in whole groups"
        )
    levels = 2**bits - 1
    grouped = _grouped(x.float(), group_size, axis)
    reduce = 3 if axis == "channel" else 4
    low, high = grouped.amin(dim=reduce, keepdim=True), grouped.amax(dim=reduce, keepdim=True)
    zero = _rounded(low, down=True)  # at or below the minimum: no code below 0
    scale = _rounded(((high - zero.float()) / levels).clamp_min(1e-7), down=False)  # at or above
    codes = ((grouped - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return PackedCodes(
        pack(_ungrouped(codes, axis), bits),
        scale.squeeze(reduce),
        zero.squeeze(reduce),
        bits,
        group_size,
        axis,
    )


def dequantize(packed: PackedCodes, dtype: torch.dtype) -> Tensor:
    """The [B, H, T, D] tensor `packed` stands for, in `dtype`."""
    codes = unpack(packed.codes, packed.bits).float()
    reduce = 3 if packed.axis == "channel" else 4
    grouped = _grouped(codes, packed.group, packed.axis)
    values = grouped * packed.scale.unsqueeze(reduce).float() + packed.zero.unsqueeze(reduce).float()
    return _ungrouped(values, packed.axis).to(dtype)


def error_bound(packed: PackedCodes) -> Tensor:
    """[B, H, T, D] float32: the largest error `dequantize` can have per element (module docstring),
    given the groups' minima it was quantized from are at most one float16 step above the zeros.
    Dequantized into a 16-bit dtype, the copy adds that dtype's rounding."""
    reduce = 3 if packed.axis == "channel" else 4
    half_step = packed.scale.float() / 2
    zero_step = _float16_step(packed.zero)  # how far the rounded-down zero may lie below the minimum
    bound = (half_step + zero_step).unsqueeze(reduce)
    expanded = bound.expand(*bound.shape[:reduce], packed.group, *bound.shape[reduce + 1 :])
    return _ungrouped(expanded, packed.axis)


def _float16_step(x: Tensor) -> Tensor:
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    return (up.float() - x.float()).abs()


def _rounded(x: Tensor, down: bool) -> Tensor:
    """`x` (float32) in SCALE_DTYPE, rounded toward -inf (`down`) or +inf, not to nearest."""
    rounded = x.to(SCALE_DTYPE)
    wrong = rounded.float() > x if down else rounded.float() < x
    toward = torch.full_like(rounded, float("-inf") if down else float("inf"))
    return torch.where(wrong, torch.nextafter(rounded, toward), rounded)


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes of `bits` bits [..., D] -> [..., D * bits / 8]: 8 // bits codes per byte, the first
    in the lowest bits."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.contiguous()
    grouped = codes.view(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of `pack`: [..., D * bits / 8] -> uint8 codes [..., D]."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = torch.tensor(2**bits - 1, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)


def concat(first: PackedCodes | None, second: PackedCodes) -> PackedCodes:
    """Codes of `first` then `second` along the tokens (same format)."""
    if first is None or first.length == 0:
        return second
    return PackedCodes(
        torch.cat([first.codes, second.codes], dim=2),
        torch.cat([first.scale, second.scale], dim=2),
        torch.cat([first.zero, second.zero], dim=2),
        first.bits,
        first.group,
        first.axis,
    )
