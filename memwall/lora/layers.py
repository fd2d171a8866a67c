"""LoRAProjection: a projection module (float or quantized, fused or not) plus the LoRA deltas
of the adapters resident in ``LoRASlots``, for a step whose tokens use different adapters.

    y = base(x)                                        the base is never dequantized or changed
    for each slot s used this step (tokens idx):       one gathered matmul pair per adapter
        y[idx, col:col+n] += (x[idx] @ A[s, :r]^T) @ Bt[s, :r]     for each target segment

``apply_lora`` wraps a built model's projections in place (after ``fuse_projections``).
The fused CPU decode step (memwall/kernels/cpu/decode.c) computes the same deltas natively,
reading the wrapped module's ``base`` and ``segments``.
"""

from __future__ import annotations

import torch
from torch import nn

from memwall.lora.slots import PROJECTIONS, LoRASlots, SlotSegment


class LoRAProjection(nn.Module):
    def __init__(self, base: nn.Module, segments: list[SlotSegment], slots: LoRASlots) -> None:
        super().__init__()
        self.base = base
        self.segments = segments
        self.slots = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        groups = self.slots.groups
        if not groups:
            return y
        for slot, idx in groups:
            xs = x.index_select(0, idx).float()  # [t, in]
            for seg in self.segments:
                r = int(seg.rank[slot])
                if r == 0:
                    continue
                delta = (xs @ seg.a[slot, :r].t()) @ seg.bt[slot, :r]  # [t, n]
                cols = slice(seg.col, seg.col + seg.n)
                y[:, cols].index_add_(0, idx, delta.to(y.dtype))
        return y


def apply_lora(model: nn.Module, slots: LoRASlots) -> None:
    """Wraps every decoder layer's projections of ``model`` (Llama-shaped: ``self_attn`` and
    ``mlp``), fused (qkv_proj, gate_up_proj) or separate, and sets ``model.lora_slots``."""
    for i, layer in enumerate(model.model.layers):
        for owner, fused, projection in ((layer.self_attn, "qkv_proj", "qkv"),
                                         (layer.self_attn, None, "o"),
                                         (layer.mlp, "gate_up_proj", "gate_up"),
                                         (layer.mlp, None, "down")):
            segments = slots.segments(i, projection)
            if fused is not None and getattr(owner, fused, None) is not None:
                setattr(owner, fused, LoRAProjection(getattr(owner, fused), segments, slots))
                continue
            for seg in segments:  # separate modules: each its own segment, from column 0
                own = SlotSegment(seg.target, 0, seg.a, seg.bt, seg.rank)
                setattr(owner, seg.target, LoRAProjection(getattr(owner, seg.target), [own], slots))
    model.lora_slots = slots


def unwrap(module: nn.Module) -> tuple[nn.Module, list[SlotSegment]]:
    """(base module, LoRA segments) of a projection; no segments when it is not wrapped."""
    if isinstance(module, LoRAProjection):
        return module.base, module.segments
    return module, []


__all__ = ["LoRAProjection", "apply_lora", "unwrap", "PROJECTIONS"]
