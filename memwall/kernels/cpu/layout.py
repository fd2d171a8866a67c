"""The weight layouts the CPU kernels read, described without knowing where a weight came from.

memwall/quant's layers describe themselves with ``PackedWeight`` (their ``native_parts()``); a
plain ``nn.Linear`` is described by ``float_weight`` here. The kernels (quant_ops.py, decode.py)
read only these descriptions, so nothing in memwall/kernels imports memwall/quant.

    kind  codes                        scales, offsets         w[n, k]
    f32   float32 [N, K]               None                    codes[n, k]
    q4    uint8   [N, K/2]             float [N, K/32]         s * q + c,  q in 0..15, a 32-value
                                                               block = 16 bytes, byte j holds
                                                               q[j] | q[j + 16] << 4
    q8    int8    [N, K]               float [N, K/group]      s * q + c,  group % 16 == 0

Scales and offsets are float32, or float16 (both the same): GGUF's Q4_0, Q4_1 and Q8_0 store
theirs as fp16, and keeping them so halves their bytes (a tenth of a Q4 weight's) with no
change to any weight; the kernels widen them as they read (``half_scales``).

All rows are contiguous and on the CPU; ``bias`` is float32 [N] or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("f32", "q4", "q8")
Q4_BLOCK = 32  # inputs per (scale, offset) pair of a q4 weight
Q8_ALIGN = 16  # a q8 group is a multiple of this many inputs (the kernels' vector width)
_CODE_DTYPES = {"f32": torch.float32, "q4": torch.uint8, "q8": torch.int8}
SCALE_DTYPES = (torch.float32, torch.float16)


class LayoutError(ValueError):
    """A weight (or its input) that does not fit the layout it claims; the message says how."""


@dataclass(frozen=True)
class PackedWeight:
    """One weight matrix [n, k] as the kernels read it: y = x @ W^T (+ bias). Checked when made."""

    kind: str  # "f32", "q4" or "q8" (see the module docstring)
    group: int  # inputs per (scale, offset) pair: 32 for q4, the group for q8, 0 for f32
    n: int  # output features
    k: int  # input features
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def half(self) -> int:
        """1 when the scales and offsets are float16 (the kernels' ``half`` argument)."""
        return 0 if self.scales is None else half_scales(self.scales)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "f32":
            _check_tensor("f32 weight", self.codes, torch.float32, (self.n, self.k))
        else:
            n, group = check_packed(self.kind, self.k, self.codes, self.scales, self.offsets)
            if (n, group) != (self.n, self.group):
                raise LayoutError(f"{self.kind} weight is {n} rows in groups of {group}, but "
                                  f"was described as {self.n} rows in groups of {self.group}")
        if self.bias is not None:
            _check_tensor("bias", self.bias, torch.float32, (self.n,))


def check_packed(kind: str, k: int, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor) -> tuple[int, int]:
    """(rows, group) of a q4 or q8 weight with ``k`` inputs; LayoutError when the tensors do
    not hold that layout (the message names the tensor, its shape and what was expected)."""
    if k < 1:
        raise LayoutError(f"{kind} weight: in_features must be at least 1, got {k}")
    n = codes.shape[0] if codes is not None and codes.dim() == 2 else -1
    groups = scales.shape[1] if scales is not None and scales.dim() == 2 else 0
    if kind == "q4":
        if k % Q4_BLOCK:
            raise LayoutError(f"q4 weight: in_features {k} is not a multiple of {Q4_BLOCK}; "
                              f"quantize such layers with int8 or keep them float")
        group, width = Q4_BLOCK, k // 2
    elif kind == "q8":
        if groups < 1 or k % groups or (k // groups) % Q8_ALIGN:
            raise LayoutError(f"q8 weight: {groups} scale groups do not split in_features {k} "
                              f"into groups that are a multiple of {Q8_ALIGN}")
        group, width = k // groups, k
    else:
        raise LayoutError(f"kind {kind!r} is not a packed layout (q4 or q8)")
    _check_tensor(f"{kind} codes", codes, _CODE_DTYPES[kind], (n, width))
    scale_dtype = scales.dtype if scales is not None and scales.dtype in SCALE_DTYPES else torch.float32
    _check_tensor(f"{kind} scales", scales, scale_dtype, (n, k // group))
    _check_tensor(f"{kind} offsets", offsets, scale_dtype, (n, k // group))
    return n, group


def half_scales(scales: torch.Tensor) -> int:
    """The kernels' ``half`` argument: 1 for float16 scales and offsets, 0 for float32."""
    return int(scales.dtype == torch.float16)


def check_input(x: torch.Tensor, k: int, what: str) -> None:
    """x must be a contiguous float32 CPU matrix [M, k] (M may be 0)."""
    if x.dim() != 2 or x.shape[1] != k:
        raise LayoutError(f"{what}: x must be [tokens, {k}], got {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise LayoutError(f"{what}: x must be contiguous float32 on the CPU, got {x.dtype} on "
                          f"{x.device} (contiguous: {x.is_contiguous()}); use x.float().contiguous()")


def _check_tensor(what: str, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple) -> None:
    if t is None:
        raise LayoutError(f"{what} is missing")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise LayoutError(f"{what} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise LayoutError(f"{what} must be contiguous on the CPU (device {t.device}, "
                          f"contiguous {t.is_contiguous()})")


def float_weight(linear: nn.Linear, bias: torch.Tensor | None = None) -> PackedWeight | None:
    """A plain Linear as an f32 weight (with its own bias unless ``bias`` is given); None when
    its tensors are not float32 contiguous CPU ones (e.g. a bf16 model)."""
    bias = linear.bias if bias is None else bias
    try:
        return PackedWeight("f32", 0, linear.out_features, linear.in_features,
                            linear.weight.detach(), bias=None if bias is None else bias.detach())
    except LayoutError:
        return None


def describe(module: nn.Module) -> list[PackedWeight] | None:
    """The kernels' view of one projection: its parts, whose outputs sit side by side. A plain
    ``nn.Linear`` is one f32 part; any other module describes itself with ``native_parts()``
    (memwall/quant's layers). None when the kernels cannot compute the module."""
    if type(module) is nn.Linear:
        weight = float_weight(module)
        return None if weight is None else [weight]
    native_parts = getattr(module, "native_parts", None)
    return native_parts() if callable(native_parts) else None
