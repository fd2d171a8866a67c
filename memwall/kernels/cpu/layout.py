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
    panels as q4 or q8 (group 32, or Q6_K's 16; N a multiple of 16; two-level tables: 8
          sub-values a superblock, Q6_K 16), each 16-row group permuted in place into the
          panels packed_gemm.c reads; flags say which format (panels.py)

Scales and offsets are tables [N, K/group] in one of three formats, both the same
(``scale_format``, the kernels' ``half`` argument; kernels.h says how they are read):
    float32           an entry each
    float16           GGUF's Q4_0, Q4_1 and Q8_0 store theirs so; keeping them halves their
                      bytes (a tenth of a Q4 weight's) with no change to any weight
    two-level uint8   [N, S, 4 + E]: GGUF's K-quants' layout. Each of the S superblocks of a
                      row holds a float32 d (4 bytes) and E int8 sub-values; entry = d * sub in
                      fp32, the same bits ggml computes (a Q4_K weight: 0.59 bytes a value
                      instead of 0.75 with float32 tables; Q6_K 1.16 instead of 1.5)
The kernels widen them to float32 as they read. A q8 weight whose offsets are all zero (GGUF's
Q8_0, Q5_0 and Q6_K keep signed codes) may pass ``offsets=None``: the one-token kernels then
never read the table (kernels.h, MW_NO_OFFSETS).

All rows are contiguous and on the CPU; ``bias`` is float32 [N] or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("f32", "q4", "q8", "panels")
Q4_BLOCK = 32  # inputs per (scale, offset) pair of a q4 weight
Q8_ALIGN = 16  # a q8 group is a multiple of this many inputs (the kernels' vector width)
_CODE_DTYPES = {"f32": torch.float32, "q4": torch.uint8, "q8": torch.int8}
# a packed weight's flags (MW_PK_* in kernels.h)
PANEL_Q8 = 1  # int8 codes; else q4
PANEL_HALF = 2  # float16 scale and offset tables; else float32
PANEL_OFFSETS = 4  # an offset table; else all offsets are zero
PANEL_TWO_LEVEL = 8  # two-level tables with 8 sub-values a superblock (Q4_K, Q5_K)
PANEL_G16 = 16  # q8 in 16-value groups, two-level tables of 16 sub-values, no offsets (Q6_K)
SCALE_DTYPES = (torch.float32, torch.float16)  # the one-entry-each formats
_D_BYTES = 4  # a two-level superblock's float32 d


class LayoutError(ValueError):
    """A weight (or its input) that does not fit the layout it claims; the message says how."""


@dataclass(frozen=True)
class PackedWeight:
    """One weight matrix [n, k] as the kernels read it: y = x @ W^T (+ bias). Checked when made."""

    kind: str  # "f32", "q4", "q8" or "panels" (see the module docstring)
    group: int  # inputs per (scale, offset) pair: 32 for q4, the group for q8 and panels, 0 for f32
    n: int  # output features
    k: int  # input features
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    flags: int = 0  # panels only: PANEL_* bits

    @property
    def scale_format(self) -> int:
        """The kernels' ``half`` argument for the scale and offset tables (``scale_format``)."""
        return 0 if self.scales is None else scale_format(self.scales)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "f32":
            _check_tensor("f32 weight", self.codes, torch.float32, (self.n, self.k))
        elif self.kind == "panels":
            g16 = bool(self.flags & PANEL_G16)
            group = 16 if g16 else Q4_BLOCK
            if self.n % 16 or self.group != group or not 0 <= self.flags < 32:
                raise LayoutError(f"panels: {self.n} rows must be a multiple of 16, the group "
                                  f"{group}, flags 0..31 (got group {self.group}, flags {self.flags})")
            kind = "q8" if self.flags & PANEL_Q8 else "q4"
            n, got = check_packed(kind, self.k, self.codes, self.scales, self.offsets)
            two_level = self.scales.dim() == 3
            sub_values = 16 if g16 else 8
            if (n, got) != (self.n, group) or (two_level and scale_format(self.scales) != sub_values):
                raise LayoutError(f"panels: a {kind} weight of {n} rows in groups of {got} "
                                  f"(tables {list(self.scales.shape)}), not {self.n} rows in "
                                  f"groups of {group} (two-level: {sub_values} sub-values a superblock)")
            half = self.scales.dtype == torch.float16
            if (bool(self.flags & PANEL_HALF) != half
                    or bool(self.flags & (PANEL_TWO_LEVEL | PANEL_G16)) != two_level
                    or (g16 and (kind != "q8" or self.offsets is not None))
                    or bool(self.flags & PANEL_OFFSETS) != (self.offsets is not None)):
                raise LayoutError(f"panels: flags {self.flags} do not match the tables "
                                  f"({self.scales.dtype}, offsets {self.offsets is not None})")
        else:
            n, group = check_packed(self.kind, self.k, self.codes, self.scales, self.offsets)
            if (n, group) != (self.n, self.group):
                raise LayoutError(f"{self.kind} weight is {n} rows in groups of {group}, but "
                                  f"was described as {self.n} rows in groups of {self.group}")
        if self.bias is not None:
            _check_tensor("bias", self.bias, torch.float32, (self.n,))


def check_packed(kind: str, k: int, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None) -> tuple[int, int]:
    """(rows, group) of a q4 or q8 weight with ``k`` inputs; LayoutError when the tensors do
    not hold that layout (the message names the tensor, its shape and what was expected)."""
    if k < 1:
        raise LayoutError(f"{kind} weight: in_features must be at least 1, got {k}")
    n = codes.shape[0] if codes is not None and codes.dim() == 2 else -1
    groups = table_groups(scales) if scales is not None and scales.dim() in (2, 3) else 0
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
    if scales is not None and scales.dim() == 3:  # two-level: offsets in the same superblocks
        shape = (n, *scales.shape[1:])
        _check_tensor(f"{kind} scales", scales, torch.uint8, shape)
        if offsets is not None:  # None: all zero (the module docstring)
            _check_tensor(f"{kind} offsets", offsets, torch.uint8, shape)
        if scales.shape[2] <= _D_BYTES + 1 or table_groups(scales) != k // group:
            raise LayoutError(f"{kind} two-level scales {list(scales.shape)}: need 2 or more "
                              f"sub-values after a {_D_BYTES}-byte d in each superblock, "
                              f"{k // group} in a row")
        return n, group
    scale_dtype = scales.dtype if scales is not None and scales.dtype in SCALE_DTYPES else torch.float32
    _check_tensor(f"{kind} scales", scales, scale_dtype, (n, k // group))
    if offsets is not None:
        _check_tensor(f"{kind} offsets", offsets, scale_dtype, (n, k // group))
    return n, group


def table_ptr(table: torch.Tensor | None) -> int:
    """A scale or offset table's address for the kernels; 0 (NULL) for an offset table left out
    because it is all zero (the module docstring)."""
    return 0 if table is None else table.data_ptr()


def scale_format(table: torch.Tensor) -> int:
    """The kernels' ``half`` argument for a scale or offset table: 0 float32, 1 float16, E for
    a two-level table of E sub-values a superblock."""
    if table.dim() == 3:
        return table.shape[2] - _D_BYTES
    return int(table.dtype == torch.float16)


def table_groups(table: torch.Tensor) -> int:
    """Entries a row of a scale or offset table holds, whatever its format."""
    return table.shape[1] * (table.shape[2] - _D_BYTES) if table.dim() == 3 else table.shape[1]


def two_level_table(d: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """d float32 [N, S], sub integers in -128..127 [N, S * E] -> the two-level table
    [N, S, 4 + E] uint8 whose entry (n, s * E + j) is d[n, s] * sub[n, s * E + j]."""
    n, supers = d.shape
    if sub.shape[0] != n or sub.shape[1] % max(supers, 1):
        raise LayoutError(f"two-level table: {tuple(sub.shape)} sub-values do not split into "
                          f"the {supers} superblocks of d {tuple(d.shape)}")
    if sub.numel() and (sub.min() < -128 or sub.max() > 127):
        raise LayoutError("two-level table: sub-values must fit a signed byte")
    e = sub.shape[1] // max(supers, 1)
    head = d.to(torch.float32).contiguous().view(torch.uint8).reshape(n, supers, _D_BYTES)
    tail = sub.to(torch.int8).reshape(n, supers, e).view(torch.uint8)
    return torch.cat([head, tail], dim=2).contiguous()


def float_table(table: torch.Tensor) -> torch.Tensor:
    """Any scale or offset table as float32 [N, groups], each entry as the kernels read it."""
    if table.dim() != 3:
        return table.float()
    n, supers, width = table.shape
    d = table[:, :, :_D_BYTES].contiguous().view(torch.float32)  # [N, S, 1]
    sub = table[:, :, _D_BYTES:].contiguous().view(torch.int8).float()  # [N, S, E]
    return (d * sub).reshape(n, supers * (width - _D_BYTES))


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
