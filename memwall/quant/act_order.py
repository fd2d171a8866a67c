"""``PermutedInput``: a quantized weight whose input columns are stored in another order.

GPTQ's act-order (``desc_act``) quantizes the input channels in order of importance, so a
scale group is a scattered set of channels (``g_idx[i]`` = the group of channel i). Our int4
layouts need each group to be a contiguous run of inputs, so the loader stores the weight with
its columns permuted (``perm = argsort(g_idx)``: groups become contiguous) and the layer
gathers the activation's columns the same way before the matmul:

    y = x[:, perm] @ W[:, perm]^T  ==  x @ W^T                 x [T, in], perm [in] int64

Any inner method multiplies the permuted weight (NativeQ4, or Int4WeightOnly when the native
kernels are not built). decode.c has no input permutation, so ``native_weight`` is None and a
model with such layers runs its torch path (same numbers, no fused decode step).
"""

from __future__ import annotations

import dataclasses

import torch

from memwall.quant.base import QuantLinear, QuantMethod, QuantWeights

PERM = "perm"  # the buffer holding the permutation


class PermutedInput(QuantMethod):
    """``inner``'s weight with input columns in ``perm`` order (a ``perm`` buffer [in] int64)."""

    def __init__(self, inner: QuantMethod) -> None:
        self.inner = inner
        self.name = inner.name

    @staticmethod
    def wrap(weights: QuantWeights, perm: torch.Tensor) -> QuantWeights:
        """``weights`` (of the permuted weight) made to gather its input by ``perm`` first."""
        tensors = {**weights.tensors, PERM: perm.to(torch.int64).contiguous()}
        return dataclasses.replace(weights, method=PermutedInput(weights.method), tensors=tensors,
                                   source=f"{weights.source} act-order")

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        raise ValueError("PermutedInput only holds checkpoints' act-order weights (the loader "
                         "builds them with PermutedInput.wrap); it quantizes nothing itself")

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x[:, layer.perm])  # inner reads its own buffers

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        """Parts that share one permutation (q/k/v and gate/up do: GPTQ orders the channels
        of a shared input the same way) join as the inner method joins them."""
        perm = parts[0].tensors.get(PERM)
        if perm is None or any(not isinstance(p.method, PermutedInput) or PERM not in p.tensors
                               or not torch.equal(p.tensors[PERM], perm) for p in parts):
            return None
        inner = [_unwrapped(p) for p in parts]
        joined = inner[0].method.concat(inner)
        return None if joined is None else PermutedInput.wrap(joined, perm)

    def __repr__(self) -> str:
        return f"PermutedInput({self.inner!r})"


def _unwrapped(weights: QuantWeights) -> QuantWeights:
    tensors = {k: t for k, t in weights.tensors.items() if k != PERM}
    return dataclasses.replace(weights, method=weights.method.inner, tensors=tensors,
                               source=weights.source.removesuffix(" act-order"))
