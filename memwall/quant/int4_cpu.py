"""Group-wise int4 weights for CPU: ``Int4WeightOnly`` on torch's tinygemm op (bf16), and
``NativeQ4`` on memwall's own fp32 kernel (memwall/kernels/cpu, used when it could be built).

One "plane" is what ``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies:

    w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]      q in 0..15, g = k // group_size

(verified by experiment; torch computes it in fp32 from bf16 scale/zero, accumulates in fp32
and rounds the output to bf16). A weight is the SUM of 1 or 2 planes: two planes hold 8-bit
or 5-bit codes exactly (hi and lo nibble), which is how GGUF Q8_0 and Q5_K stay exact.

Why bf16 activations: the op's only vectorized (AVX512/AVX2) kernel is the bf16 one; with
float32 or float16 inputs it runs a scalar loop 10-30x slower than float32 F.linear. So
``apply`` casts x to bf16 and back. Why a second path for many tokens: tinygemm is a GEMV
kernel (blocks of 4 rows); from ~64 tokens on, dequantizing the weight to bf16 and calling
F.linear (oneDNN, AMX where present) is faster than it, so prefill does that.

Layout constraints of the op: out_features % 16 == 0 (we pad rows with zero weights and
slice the output), in_features % group_size == 0, group_size in {32, 64, 128, 256}.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from memwall.kernels.cpu import quant_ops
from memwall.kernels.cpu.layout import PackedWeight
from memwall.quant.base import (QuantLinear, QuantMethod, QuantWeights, columns_of, rows_of,
                                scale_tables, stack_rows)

GROUP_SIZES = (32, 64, 128, 256)
# From this many tokens on, dequantize to bf16 and use F.linear (see the module docstring;
# measured crossover on a 2-core Xeon with AMX: ~48-64 tokens for 1536x576).
DEQUANT_MIN_TOKENS = 64
_PACK_CHUNK_ROWS = 4096  # a multiple of every BLOCK_N (16/32/64), so chunked packing == whole
_ROW_ALIGN = 16


# --------------------------------------------------------------------------- packing

def pack_planes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> dict[str, torch.Tensor]:
    """Codes and per-group scale/zero -> the buffers of an int4 ``QuantLinear``.

    q: [P, N, K] integers 0..15 (any int dtype); scale, zero: [P, N, K/group] float.
    Returns ``qweight`` uint8 [P, Np, K/2] in torch's CPU-specific packed order and
    ``scales_zeros`` bf16 [P, K/group, Np, 2], with Np = N rounded up to 16 (zero rows).
    """
    planes, n, k = q.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"int4: group_size {group_size} must be one of {GROUP_SIZES} and "
                         f"divide in_features {k}")
    pad = -n % _ROW_ALIGN
    if pad:  # code 8 with scale 0 and zero 0 is an exact 0.0
        q = F.pad(q, (0, 0, 0, pad), value=8)
        scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
    qweight = torch.stack([_pack_rows(q[p]) for p in range(planes)])  # [P, Np, K/2]
    sz = torch.stack([scale, zero], dim=-1).transpose(1, 2)  # [P, K/g, Np, 2]
    return {"qweight": qweight, "scales_zeros": sz.to(torch.bfloat16).contiguous()}


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] uint8, packed a few thousand rows at a time (the op wants
    int32 input: 4 bytes a code, too much to hold for a whole 50k-row head at once)."""
    chunks = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q[i:i + _PACK_CHUNK_ROWS].to(torch.int32).contiguous(), 1)
        for i in range(0, q.shape[0], _PACK_CHUNK_ROWS)]
    return torch.cat(chunks)


# --------------------------------------------------------------------------- unpacking (for prefill)

def _unpack_rows(packed: torch.Tensor, k: int, block_n: int, halves: bool) -> torch.Tensor:
    """[N, K/2] packed -> [N, K] uint8 codes, for one candidate torch layout.

    torch packs rows in blocks of BLOCK_N (64 with AVX512, 32 with AVX2 or none), each block
    stored as [K, BLOCK_N/2] bytes. In a full block byte j holds either rows (j, j + BLOCK_N/2)
    ("halves", the vectorized builds) or rows (2j, 2j+1) ("pairs"); a last partial block
    always uses pairs. Which layout this build uses is found by ``_layout`` with a probe.
    """
    n = packed.shape[0]
    full = n // block_n * block_n
    parts = []
    if full:
        b = packed[:full].reshape(full // block_n, k, block_n // 2)  # [NB, K, BN/2]
        if halves:
            codes = torch.cat([b & 15, b >> 4], dim=2)  # [NB, K, BN]
        else:
            codes = torch.stack([b & 15, b >> 4], dim=3).reshape(full // block_n, k, block_n)
        parts.append(codes.transpose(1, 2).reshape(full, k))
    if n > full:
        b = packed[full:].reshape(k, (n - full) // 2)
        parts.append(torch.stack([b & 15, b >> 4], dim=-1).reshape(k, n - full).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


@functools.cache
def _layout() -> tuple[int, bool] | None:
    """The (BLOCK_N, halves) packing of this torch build and CPU, or None when no known
    layout round-trips (then we never unpack and tinygemm serves every batch size)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64 * 2 + 48, 64), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for candidate in ((64, True), (32, True), (32, False), (16, False), (64, False)):
        try:
            if torch.equal(_unpack_rows(packed, 64, *candidate).to(torch.int32), q):
                return candidate
        except RuntimeError:
            continue
    return None


def dequantize_int4(layer: QuantLinear) -> torch.Tensor:
    """The layer's weight as float32 [Np, K] (sum of planes); needs a known ``_layout``."""
    layout = _layout()
    assert layout is not None, "int4 unpacking is not available on this torch build"
    group, k = layer.extra["group_size"], layer.in_features
    w = None
    for qweight, sz in zip(layer.qweight, layer.scales_zeros):
        codes = _unpack_rows(qweight, k, *layout)  # [Np, K] uint8
        s, z = sz.float().permute(1, 0, 2).unsqueeze(2).unbind(-1)  # [Np, K/g, 1] each
        plane = codes.view(codes.shape[0], k // group, group).float().mul_(s).add_(z - 8 * s)
        w = plane if w is None else w.add_(plane)
    return w.view(-1, k)


# --------------------------------------------------------------------------- the method

def _to_bf16_up(t: torch.Tensor) -> torch.Tensor:
    """Round positive values to bf16 without rounding down (so a range scaled by it still
    fits the code range); exact for values already bf16."""
    b = t.to(torch.bfloat16)
    return torch.where(b.float() < t, torch.nextafter(b, torch.full_like(b, float("inf"))), b).float()


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group: w [N, K] -> (q uint8 [N, K], scale, zero [N, K/g]).

    zero is the group's midpoint and scale covers the larger half-range in 7 steps, both
    rounded to bf16 first (the op reads bf16) so |w - dequant| <= scale/2 holds exactly.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    zero = ((lo + hi) / 2).to(torch.bfloat16).float()  # [N, K/g], the value of code 8
    half = torch.maximum(hi - zero, zero - lo)
    scale = _to_bf16_up(torch.where(half > 0, half / 7, torch.ones_like(half)))
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    return q.clamp_(0, 15).to(torch.uint8).reshape(n, k), scale, zero


class Int4WeightOnly(QuantMethod):
    """Weight-only int4, group-wise scale and zero, bf16 compute. ``group_size`` in 32..256."""

    name = "int4"

    def __init__(self, group_size: int = 32) -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size {group_size} is not supported; use one of {GROUP_SIZES}")
        self.group_size = group_size

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % self.group_size == 0

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        n, k = weight.shape
        if not self.supports(n, k):
            raise ValueError(f"int4: in_features {k} is not a multiple of group_size {self.group_size}")
        q, scale, zero = quantize_int4(weight, self.group_size)
        return self.from_planes(q[None], scale[None], zero[None], source=f"int4 g{self.group_size}")

    def from_planes(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    source: str) -> QuantWeights:
        """QuantWeights from codes [P, N, K] and scale/zero [P, N, K/g] (see ``pack_planes``)."""
        tensors = pack_planes(q, scale, zero, self.group_size)
        return QuantWeights(self, tensors, out_features=q.shape[1], in_features=q.shape[2],
                            source=source, extra={"group_size": self.group_size})

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()  # [T, in]
        if xb.shape[0] >= DEQUANT_MIN_TOKENS and _layout() is not None:
            y = F.linear(xb, dequantize_int4(layer).to(torch.bfloat16))  # [T, Np]
        else:
            y = self._tinygemm(layer, xb)
        return y[:, :layer.out_features].to(x.dtype)

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        layout = _layout()
        first = parts[0].tensors["qweight"]
        if layout is None or any(
                not isinstance(p.method, Int4WeightOnly) or p.extra != parts[0].extra
                or p.in_features != parts[0].in_features
                or p.tensors["qweight"].shape[0] != first.shape[0] for p in parts):
            return None
        if all(p.out_features % layout[0] == 0 for p in parts):
            # whole packing blocks: packed rows concatenate as the codes would
            tensors = {"qweight": torch.cat([p.tensors["qweight"] for p in parts], dim=1),
                       "scales_zeros": torch.cat([p.tensors["scales_zeros"] for p in parts], dim=2)}
        else:
            tensors = self._repack_concat(parts, layout)
        out = sum(p.out_features for p in parts)
        sources = sorted({p.source for p in parts})
        return QuantWeights(self, tensors, out, parts[0].in_features, " + ".join(sources),
                            dict(parts[0].extra))

    def _repack_concat(self, parts: list[QuantWeights], layout: tuple[int, bool]) -> dict[str, torch.Tensor]:
        """Unpack every part's codes (dropping pad rows), join them and pack again."""
        k = parts[0].in_features
        codes, scales, zeros = [], [], []
        for p in parts:
            n = p.out_features
            codes.append(torch.stack([_unpack_rows(qw, k, *layout)[:n] for qw in p.tensors["qweight"]]))
            sz = p.tensors["scales_zeros"][:, :, :n].float().transpose(1, 2)  # [P, n, K/g, 2]
            scales.append(sz[..., 0])
            zeros.append(sz[..., 1])
        return pack_planes(torch.cat(codes, 1), torch.cat(scales, 1), torch.cat(zeros, 1),
                           parts[0].extra["group_size"])

    def _tinygemm(self, layer: QuantLinear, xb: torch.Tensor) -> torch.Tensor:
        group = layer.extra["group_size"]
        outs = [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, qw, group, sz)
                for qw, sz in zip(layer.qweight, layer.scales_zeros)]  # each [T, Np] bf16
        if len(outs) == 1:
            return outs[0]
        return torch.stack(outs).float().sum(0)  # planes add in fp32, not bf16

    def __repr__(self) -> str:
        return f"Int4WeightOnly(group_size={self.group_size})"


# --------------------------------------------------------------------------- our own fp32 kernel

def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N, K/2] uint8 in the kernels' q4 layout (memwall/kernels/cpu/
    layout.py; per 32-value block, byte j = q[j] | q[j+16] << 4: ggml's Q4_0/Q4_1 blocks)."""
    n, k = q.shape
    b = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class NativeQ4(QuantMethod):
    """4-bit codes in 32-value blocks, w = s * q + c with fp16 (where exact) or fp32 s and c,
    computed in fp32 by memwall/kernels/cpu (bit-identical weights to the GGUF reference
    dequantizer)."""

    name = "int4"

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % 32 == 0

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        n, k = weight.shape
        if not self.supports(n, k):
            raise ValueError(f"int4: in_features {k} is not a multiple of 32")
        q, scale, zero = quantize_int4(weight, 32)
        return self.from_codes(q, scale, zero - 8 * scale, source="int4 g32")

    def from_codes(self, q: torch.Tensor, s: torch.Tensor, c: torch.Tensor, source: str) -> QuantWeights:
        """q [N, K] codes 0..15; s, c [N, K/32] float: w = s * q + c."""
        return self.from_packed(pack_nibbles(q), s, c, source)

    def from_packed(self, codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor,
                    source: str) -> QuantWeights:
        """codes [N, K/2] uint8 already in the q4 layout (``pack_nibbles``); s, c as above, or
        two-level tables (memwall/kernels/cpu/layout.py)."""
        s, c = scale_tables(s, c)
        tensors = {"codes": codes.to(torch.uint8).contiguous(), "s": s, "c": c}
        return QuantWeights(self, tensors, out_features=codes.shape[0],
                            in_features=2 * codes.shape[1], source=source)

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        return stack_rows(self, parts)

    def column_unit(self, layer: QuantLinear) -> int:
        return 32  # a block's 16 bytes interleave its two halves: cut between blocks only

    def take_rows(self, layer: QuantLinear, index: torch.Tensor) -> QuantWeights:
        return rows_of(layer, index)

    def take_columns(self, layer: QuantLinear, start: int, stop: int) -> QuantWeights:
        return columns_of(layer, start, stop, {"codes": 2, "s": 32, "c": 32}, 32)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        y = quant_ops.q4_matmul(x.float().contiguous(), layer.codes, layer.s, layer.c)  # [T, out]
        return y.to(x.dtype)

    def native_weight(self, layer: QuantLinear, bias: torch.Tensor | None) -> PackedWeight:
        return PackedWeight("q4", 32, layer.out_features, layer.in_features, layer.codes,
                            layer.s, layer.c, bias)
