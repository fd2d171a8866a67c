"""Packs a loaded model's q4/q8 weights into 16-row panels (memwall/kernels/cpu/panels.py), in
place, once the model has its final shape.

``pack_model(model)`` runs after loading, fusing and tensor-parallel sharding (the worker calls
it): every ``QuantLinear`` of ``NativeQ4`` / ``NativeQ8`` whose layout fits (``panels.fits``:
GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and our int4, rows a multiple of 16) gets
its tensors permuted in place and ``PanelMethod`` as its method; a ``QuantEmbedding`` sharing a packed
head's tensors (a tied embedding) reads its rows from the panels. Nothing is copied, so memory
stays as it was. Where the kernels have no AVX-512 VNNI (or MEMWALL_PANELS=0) nothing changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from memwall.kernels.cpu import panels
from memwall.kernels.cpu.layout import PANEL_G16, PANEL_OFFSETS, PackedWeight
from memwall.quant.base import QuantLinear, QuantMethod, QuantWeights
from memwall.quant.embedding import QuantEmbedding
from memwall.quant.int4_cpu import NativeQ4
from memwall.quant.int8_cpu import NativeQ8


class PanelMethod(QuantMethod):
    """A NativeQ4 / NativeQ8 weight packed into panels: the layer keeps its buffers (codes, s,
    c), permuted. Matmuls of any size go to packed_gemm.c; cutting the layer (tensor
    parallelism, fusing) works on an unpacked copy and gives the inner method's row layout."""

    name = "panels"

    def __init__(self, inner: QuantMethod, flags: int) -> None:
        self.inner = inner
        self.flags = flags
        self._weight: PackedWeight | None = None  # built once: apply runs every step

    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        raise ValueError("panels pack loaded weights (pack_model); quantize with "
                         f"{type(self.inner).__name__}")

    def packed(self, layer: QuantLinear) -> PackedWeight:
        """The layer's weight as the kernels read it (no bias)."""
        w = self._weight
        if w is None or w.codes is not layer.codes or w.scales is not layer.s:
            offsets = layer.c if self.flags & PANEL_OFFSETS else None
            group = 16 if self.flags & PANEL_G16 else panels.BLOCK
            w = PackedWeight("panels", group, layer.out_features, layer.in_features,
                             layer.codes, layer.s, offsets, flags=self.flags)
            self._weight = w
        return w

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return panels.matmul(x.float().contiguous(), self.packed(layer)).to(x.dtype)

    def native_weight(self, layer: QuantLinear, bias: torch.Tensor | None) -> PackedWeight:
        return dataclasses.replace(self.packed(layer), bias=bias)

    def supports(self, out_features: int, in_features: int) -> bool:
        return self.inner.supports(out_features, in_features)

    def column_unit(self, layer: QuantLinear) -> int | None:
        return self.inner.column_unit(layer)  # read from the tables' shapes, which packing keeps

    def take_rows(self, layer: QuantLinear, index: torch.Tensor) -> QuantWeights | None:
        return self.inner.take_rows(self.unpacked(layer), index)

    def take_columns(self, layer: QuantLinear, start: int, stop: int) -> QuantWeights | None:
        return self.inner.take_columns(self.unpacked(layer), start, stop)

    def unpacked(self, layer: QuantLinear) -> QuantLinear:
        """A copy of the layer in the inner method's row layout."""
        plain = panels.unpacked_copy(self.packed(layer))
        tensors = {"codes": plain.codes, "s": plain.scales,
                   "c": plain.offsets if plain.offsets is not None else layer.c}
        return QuantLinear(QuantWeights(self.inner, tensors, layer.out_features,
                                        layer.in_features, layer.source, dict(layer.extra)))

    def __repr__(self) -> str:
        return f"PanelMethod({self.inner!r})"


@dataclass(frozen=True)
class PackReport:
    layers: int = 0  # Linears packed
    nbytes: int = 0  # their codes and tables
    embedding: bool = False  # a tied embedding now reads the packed head's rows

    def summary(self) -> str:
        if not self.layers:
            return "weights in the row layout"
        tied = ", the tied embedding reads them" if self.embedding else ""
        return f"{self.layers} weights ({self.nbytes / 2**20:.0f} MiB) packed into 16-row panels{tied}"


def pack_model(model: nn.Module) -> PackReport:
    """Packs ``model`` in place (module docstring); safe to call again (packed layers are
    skipped). Call after the model is cut to its final shape."""
    if not panels.available():
        return PackReport()
    packed: dict[int, PackedWeight] = {}  # codes address -> the packed weight
    layers = nbytes = 0
    for module in model.modules():
        if not isinstance(module, QuantLinear) or type(module.method) not in (NativeQ4, NativeQ8):
            continue
        weight = module.method.native_weight(module, None)
        if weight is None or not panels.fits(weight):
            continue
        address = weight.codes.data_ptr()
        done = packed.get(address) or panels.pack_(weight)  # two layers on one tensor: once
        packed[address] = done
        module.method = PanelMethod(module.method, done.flags)
        layers += 1
        nbytes += sum(t.nbytes for t in (done.codes, done.scales, done.offsets) if t is not None)
    embedding = False
    for module in model.modules():
        if isinstance(module, QuantEmbedding) and module.codes.data_ptr() in packed:
            module.read_panels(packed[module.codes.data_ptr()])
            embedding = True
    return PackReport(layers, nbytes, embedding)
