"""Int8 weights for CPU: ``Int8WeightOnly`` (per output channel) on
``torch.ops.aten._weight_int8pack_mm`` (bf16), and ``NativeQ8`` (a scale and offset per group)
on memwall's own fp32 kernel (memwall/kernels/cpu, used when it could be built).

    w[n, k] = q[n, k] * scale[n]          q in -127..127

The op computes ``(x @ q.T) * scale`` with bf16 x and bf16 scales (float32 inputs take a
slow scalar path, so ``apply`` casts x to bf16 and back). It crashes on in_features that
are not a multiple of 16, which ``supports`` refuses. From ``DEQUANT_MIN_TOKENS`` tokens
on, the int8 weight is widened to bf16 for F.linear (oneDNN) and the scale applied to the
output, which is exact algebra and much faster than the op's GEMV kernel at prefill sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memwall.kernels.cpu import quant_ops
from memwall.kernels.cpu.layout import PackedWeight, table_groups
from memwall.quant.base import (QuantLinear, QuantMethod, QuantWeights, columns_of, rows_of,
                                scale_tables, stack_rows)
from memwall.quant.int4_cpu import DEQUANT_MIN_TOKENS, _to_bf16_up

_K_ALIGN = 16


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [N, K] -> (q int8 [N, K], scale float [N]).

    The scale is rounded to bf16 (never down) before q is computed, so
    |w - q * scale| <= scale / 2 holds for the scale the op really uses.
    """
    w = w.float()
    amax = w.abs().amax(dim=1)  # [N]
    scale = _to_bf16_up(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnly(QuantMethod):
    """Weight-only int8 with one scale per output channel, bf16 compute."""

    name = "int8"

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % _K_ALIGN == 0

    def create_weights(self, weight: torch.Tensor, source: str = "int8 per-channel") -> QuantWeights:
        n, k = weight.shape
        if not self.supports(n, k):
            raise ValueError(f"int8: in_features {k} must be a multiple of {_K_ALIGN} "
                             f"(torch's int8 kernel needs it)")
        q, scale = quantize_int8(weight)
        tensors = {"qweight": q, "scales": scale.to(torch.bfloat16)}
        return QuantWeights(self, tensors, out_features=n, in_features=k, source=source)

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        return stack_rows(self, parts)

    def column_unit(self, layer: QuantLinear) -> int:
        return _K_ALIGN

    def take_rows(self, layer: QuantLinear, index: torch.Tensor) -> QuantWeights:
        return rows_of(layer, index)

    def take_columns(self, layer: QuantLinear, start: int, stop: int) -> QuantWeights:
        return columns_of(layer, start, stop, {"qweight": 1}, _K_ALIGN)  # scales: one per output row

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()  # [T, in]
        if xb.shape[0] >= DEQUANT_MIN_TOKENS:
            y = F.linear(xb, layer.qweight.to(torch.bfloat16)).float() * layer.scales.float()  # [T, out]
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, layer.qweight, layer.scales)
        return y.to(x.dtype)


class NativeQ8(QuantMethod):
    """8-bit codes with a float scale and offset per group of ``G`` inputs (w = s * q + c),
    computed in fp32 by memwall/kernels/cpu. For float checkpoints G = in_features
    (per-channel); GGUF Q8_0/Q5_0/Q5_1/Q5_K use G = 32 and Q6_K G = 16, exactly."""

    name = "int8"

    def __init__(self, group_size: int | None = None) -> None:
        """``group_size``: inputs one scale covers when a float weight is quantized (None: the
        whole row, per-channel; 32: GGUF Q8_0's blocks, which pack into the 16-row panels
        of memwall/kernels/cpu/panels.py, the fast path on AVX-512 VNNI). A weight whose rows
        do not split into whole groups is quantized per-channel."""
        if group_size is not None and (group_size <= 0 or group_size % _K_ALIGN):
            raise ValueError(f"int8: a group of {group_size} inputs is not a multiple of {_K_ALIGN}")
        self.group_size = group_size

    def supports(self, out_features: int, in_features: int) -> bool:
        return in_features % _K_ALIGN == 0

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        n, k = weight.shape
        if not self.supports(n, k):
            raise ValueError(f"int8: in_features {k} must be a multiple of {_K_ALIGN}")
        if self.group_size is None or k % self.group_size:
            q, scale = quantize_int8(weight)
            return self.from_codes(q, scale[:, None], torch.zeros(n, 1), source="int8 per-channel")
        groups = k // self.group_size
        q, scale = quantize_int8(weight.reshape(n * groups, self.group_size))
        return self.from_codes(q.reshape(n, k), scale.reshape(n, groups), torch.zeros(n, groups),
                               source=f"int8 g{self.group_size}")

    def from_codes(self, q: torch.Tensor, s: torch.Tensor, c: torch.Tensor, source: str) -> QuantWeights:
        """q [N, K] int8-range codes; s, c [N, K/G] float with G % 16 == 0."""
        n, k = q.shape
        groups = table_groups(s)
        if k % groups or (k // groups) % _K_ALIGN:
            raise ValueError(f"int8: group of {k // groups} inputs is not a multiple of {_K_ALIGN}")
        s, c = scale_tables(s, c)
        tensors = {"codes": q.to(torch.int8).contiguous(), "s": s, "c": c}
        return QuantWeights(self, tensors, out_features=n, in_features=k, source=source)

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        return stack_rows(self, parts)  # also refuses parts with other group sizes

    def column_unit(self, layer: QuantLinear) -> int:
        groups = table_groups(layer.s)
        return _K_ALIGN if groups == 1 else layer.in_features // groups  # per-channel: any aligned cut

    def take_rows(self, layer: QuantLinear, index: torch.Tensor) -> QuantWeights:
        return rows_of(layer, index)

    def take_columns(self, layer: QuantLinear, start: int, stop: int) -> QuantWeights:
        groups = table_groups(layer.s)
        if groups == 1:  # one (s, c) per row: the cut keeps them, its group = its width
            return columns_of(layer, start, stop, {"codes": 1}, _K_ALIGN)
        group = layer.in_features // groups
        return columns_of(layer, start, stop, {"codes": 1, "s": group, "c": group}, group)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        y = quant_ops.q8_matmul(x.float().contiguous(), layer.codes, layer.s,
                                layer.offsets_or_none())  # [T, out]
        return y.to(x.dtype)

    def native_weight(self, layer: QuantLinear, bias: torch.Tensor | None) -> PackedWeight:
        return PackedWeight("q8", layer.in_features // table_groups(layer.s), layer.out_features,
                            layer.in_features, layer.codes, layer.s, layer.offsets_or_none(), bias)
