"""The quantization contract: a per-layer strategy (``QuantMethod``) and the module that
carries its tensors (``QuantLinear``).

A method decides how one Linear's weight is stored and multiplied:

    create_weights(w [out, in] float)  -> QuantWeights   (quantize a float checkpoint)
    apply(layer, x [T, in])            -> y [T, out]      (the matmul, weight kept quantized)

GGUF files skip ``create_weights``: ``gguf_repack`` turns their raw blocks straight into
``QuantWeights`` of the method that can hold them. ``QuantLinear`` is a drop-in for
``nn.Linear`` (same ``in_features``/``out_features``/``bias``), so the model code never knows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from memwall.kernels.cpu.layout import float_table, scale_format

if TYPE_CHECKING:
    from memwall.kernels.cpu.layout import PackedWeight


@dataclass
class QuantWeights:
    """Everything a ``QuantLinear`` needs, before it becomes a module.

    ``tensors`` are registered as buffers under their names; ``method`` reads them back in
    ``apply``. ``source`` says where they came from (e.g. "gguf Q4_1", "int8 per-channel"),
    for logs and reports only.
    """

    method: "QuantMethod"
    tensors: dict[str, torch.Tensor]
    out_features: int
    in_features: int
    source: str = ""
    extra: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class QuantMethod(ABC):
    """How a Linear's weight is stored and multiplied. Stateless apart from its settings."""

    name: str = "?"

    @abstractmethod
    def create_weights(self, weight: torch.Tensor) -> QuantWeights:
        """Quantize a float weight ``[out, in]``. Raises ValueError for shapes it cannot hold."""

    @abstractmethod
    def apply(self, layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (any float dtype) -> ``[T, out]`` in ``x.dtype``, bias not added."""

    def supports(self, out_features: int, in_features: int) -> bool:
        """False when ``create_weights`` would refuse this shape (the layer then stays float)."""
        return True

    def concat(self, parts: list[QuantWeights]) -> QuantWeights | None:
        """One weight whose output rows are ``parts``' rows in order (fusing q/k/v or
        gate/up into one matmul); None when this method cannot join these parts."""
        return None

    # ---- tensor parallel (memwall/distributed/tensor_parallel.py cuts layers with these) ----
    def column_unit(self, layer: "QuantLinear") -> int | None:
        """Inputs are cut only at multiples of this (a scale group, a packed block); None:
        this layout cannot be cut along its inputs."""
        return None

    def take_rows(self, layer: "QuantLinear", index: torch.Tensor) -> QuantWeights | None:
        """The weight of output rows ``index`` (int64 [n]); None when this layout cannot."""
        return None

    def take_columns(self, layer: "QuantLinear", start: int, stop: int) -> QuantWeights | None:
        """The weight of inputs start..stop-1 (multiples of ``column_unit``); None when this
        layout cannot."""
        return None

    def native_weight(self, layer: "QuantLinear", bias: torch.Tensor | None) -> "PackedWeight | None":
        """The layer's weight (with ``bias``) in a layout memwall/kernels/cpu reads, for the
        fused decode step; None when the kernels cannot read this method's tensors."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def scale_tables(s: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A native q4/q8 layout's scales and offsets: float16 when that holds every value exactly
    (GGUF's Q4_0, Q4_1 and Q8_0 store fp16 scales: their weights then cost 0.625 and 1.0625
    bytes a value instead of 0.75 and 1.25, and not one weight changes), else float32 (K-quants'
    products of two scales, our own quantizers' scales). Two-level tables (``s.dim() == 3``,
    memwall/kernels/cpu/layout.py ``two_level_table``: GGUF's K-quants) are kept as built."""
    if s.dim() == 3:
        return s.contiguous(), c.contiguous()
    s, c = s.float().contiguous(), c.float().contiguous()
    s16, c16 = s.half(), c.half()
    if torch.equal(s16.float(), s) and torch.equal(c16.float(), c):
        return s16, c16
    return s, c


def stack_rows(method: QuantMethod, parts: list[QuantWeights]) -> QuantWeights | None:
    """``concat`` for layouts that keep one row of every tensor per output feature: the parts'
    tensors stacked along dim 0. None unless every part is of ``method``'s type with the same
    input size and tensor shapes past dim 0 (e.g. the same number of scale groups)."""
    first = parts[0]
    if any(type(p.method) is not type(method) or p.in_features != first.in_features
           or p.tensors.keys() != first.tensors.keys()
           or any(t.shape[1:] != first.tensors[name].shape[1:] for name, t in p.tensors.items())
           for p in parts):
        return None
    tensors = {name: torch.cat([p.tensors[name] for p in parts]) for name in first.tensors}
    return QuantWeights(method, tensors, sum(p.out_features for p in parts), first.in_features,
                        " + ".join(sorted({p.source for p in parts})))


def rows_of(layer: "QuantLinear", index: torch.Tensor) -> QuantWeights:
    """``take_rows`` for layouts that keep one row of every tensor per output feature."""
    tensors = {name: t.index_select(0, index).contiguous() for name, t in layer.named_buffers()}
    return QuantWeights(layer.method, tensors, len(index), layer.in_features, layer.source,
                        dict(layer.extra))


def columns_of(layer: "QuantLinear", start: int, stop: int, inputs_per_column: dict[str, int],
               unit: int) -> QuantWeights:
    """``take_columns`` for row-wise layouts: tensor ``name``'s columns cover
    ``inputs_per_column[name]`` inputs each (absent: one column for the whole row, kept as is);
    cuts only at multiples of ``unit``."""
    if start % unit or stop % unit or not 0 <= start < stop <= layer.in_features:
        raise ValueError(f"cannot cut inputs {start}..{stop} of {layer.in_features}: this "
                         f"layout is cut at multiples of {unit}")
    tensors = {}
    for name, t in layer.named_buffers():
        per = inputs_per_column.get(name, 0)
        if per == 0 or t.dim() == 1:
            tensors[name] = t  # a scale per output row: every input slice shares it
            continue
        if t.dim() == 3:  # a two-level table: cut whole superblocks, else cut its floats
            span = per * scale_format(t)  # inputs one superblock covers
            if start % span == 0 and stop % span == 0:
                tensors[name] = t[:, start // span: stop // span].contiguous()
                continue
            t = float_table(t)
        tensors[name] = t[:, start // per: stop // per].contiguous()
    return QuantWeights(layer.method, tensors, layer.out_features, stop - start, layer.source,
                        dict(layer.extra))


class QuantLinear(nn.Module):
    """A Linear whose weight stays quantized in memory. ``forward(x [..., in]) -> [..., out]``."""

    def __init__(self, weights: QuantWeights, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.method = weights.method
        self.in_features, self.out_features = weights.in_features, weights.out_features
        self.source, self.extra = weights.source, weights.extra
        for name, t in weights.tensors.items():
            self.register_buffer(name, t)
        # a Parameter like nn.Linear's, so code that reads .bias keeps working
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.method.apply(self, x.reshape(-1, self.in_features))  # [T, out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def offsets_or_none(self) -> torch.Tensor | None:
        """The offset table ``c``, or None when every entry is zero (GGUF Q8_0 / Q5_0 / Q6_K:
        the kernels then skip the offset term and never read the table). Checked once per
        buffer and version, so a buffer replaced or written in place is checked again (a
        tensor made under inference_mode has no version: once per buffer)."""
        c = getattr(self, "c", None)
        if c is None:
            return None
        key = (c.data_ptr(), c.shape, None if c.is_inference() else c._version)
        if getattr(self, "_offsets_key", None) != key:
            self._offsets_key, self._offsets_zero = key, not bool(c.any())
        return None if self._offsets_zero else c

    def native_parts(self) -> "list[PackedWeight] | None":
        """How memwall/kernels/cpu reads this layer (layout.py ``describe``), or None."""
        weight = self.method.native_weight(self, self.bias)
        return None if weight is None else [weight]

    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method!r}, source={self.source!r}")
