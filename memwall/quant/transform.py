"""``quantize_model``: swap a built model's ``nn.Linear`` modules for ``QuantLinear``, in place.

The model code stays as it is (gpt-fast's "a feature is a transformation of a plain model").
A tied ``lm_head`` gets a quantized copy of the table, since the head is the largest matmul of
a decode step for small models. Float embeddings are never quantized (a lookup reads a few rows
a step, so quantizing saves memory but no time, and would change the model); an embedding that
a GGUF file already stores quantized becomes a ``QuantEmbedding`` (memwall/quant/embedding.py),
sharing a tied head's buffers, when ``gguf_raw`` names it ``model.embed_tokens``.

Quantize before fusing: the loader quantizes the checkpoint's own Linears (q_proj, k_proj, ...)
and the model's ``fuse_projections()`` then joins them with ``concat_quantized``, the one place
quantized layers are joined.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from memwall.quant.base import QuantLinear, QuantMethod, QuantWeights

if TYPE_CHECKING:
    from memwall.kernels.cpu.layout import PackedWeight


EMBEDDING = "model.embed_tokens"


@dataclass
class QuantizeReport:
    """What ``quantize_model`` did. Bytes count the Linear weights only."""

    quantized: dict[str, str] = field(default_factory=dict)  # module -> source ("gguf Q4_1", ...)
    kept_float: list[str] = field(default_factory=list)
    float_bytes: int = 0  # the replaced weights as they were (a weight tied elsewhere counts too)
    quant_bytes: int = 0  # the QuantLinear buffers that replaced them
    embedding: str = ""  # the source of a QuantEmbedding, "" when the embedding stayed float

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for source in self.quantized.values():
            kinds[source] = kinds.get(source, 0) + 1
        what = ", ".join(f"{n} x {s}" for s, n in sorted(kinds.items())) or "nothing"
        embedding = f"; embedding kept as {self.embedding}" if self.embedding else ""
        return (f"quantized {what}; {len(self.kept_float)} Linear(s) kept float; weights "
                f"{self.float_bytes / 2**20:.1f} MiB -> {self.quant_bytes / 2**20:.1f} MiB"
                f"{embedding}")


def get_quant_method(name: str, group_size: int = 32, backend: str = "auto") -> QuantMethod:
    """``"int8"`` or ``"int4"``, a scale every ``group_size`` inputs. backend "native" (our
    kernels; int4 then needs group_size 32; int8 takes any multiple of 16, per-channel where a
    row does not split into groups; 32, the default, is GGUF Q8_0's block), "torch" (torch's
    bf16 ops: int8 per-channel, int4 group_size 32..256) or "auto" (native when it could be
    built and fits).

    Why native int8 in 32s: the 16-row panels (the AVX-512 VNNI kernels) take blocks of 32,
    not one scale a row; a row-scaled 4096 x 2048 int8 weight took 0.91 ms a decode token
    in the row layout against 0.48 ms in panels (Cascade Lake Xeon, 2 threads), for one bit
    more a weight (an fp16 scale and an all-zero fp16 offset a block, as GGUF's Q8_0) and a
    closer fit."""
    if name == "fp8":  # the GPU format (memwall/quant/fp8.py); no CPU kernel choice to make
        from memwall.quant.fp8 import Fp8Linear
        return Fp8Linear()
    from memwall.quant.gguf_repack import use_native
    if name == "int8":
        from memwall.quant.int8_cpu import Int8WeightOnly, NativeQ8
        return NativeQ8(group_size=group_size) if use_native(backend) else Int8WeightOnly()
    if name == "int4":
        from memwall.quant.int4_cpu import Int4WeightOnly, NativeQ4
        if group_size == 32 and use_native(backend):
            return NativeQ4()
        if backend == "native":
            raise ValueError(f"the native int4 kernel uses groups of 32, not {group_size}")
        return Int4WeightOnly(group_size)
    raise ValueError(f"unknown quantization {name!r}; use 'int8', 'int4' or 'fp8'")


def quantize_model(model: nn.Module, method: QuantMethod | str | None,
                   gguf_raw: dict[str, QuantWeights] | None = None,
                   include_lm_head: bool = True) -> QuantizeReport:
    """Replace ``model``'s Linear layers by quantized ones, in place; returns what changed.

    A layer named in ``gguf_raw`` (from ``gguf_quantized_linears``: the checkpoint's module
    names) takes those weights and keeps its own bias. Any other Linear is quantized from its
    float weight by ``method`` (a QuantMethod, ``"int8"``, ``"int4"``, or None to leave it
    float); shapes ``method`` cannot hold stay float. ``gguf_raw``'s ``model.embed_tokens``
    (see EMBEDDING) replaces the embedding by a ``QuantEmbedding``. Call after loading and
    before ``fuse_projections()`` (which joins quantized parts with ``concat_quantized``).
    """
    if isinstance(method, str):
        method = get_quant_method(method)
    gguf_raw = gguf_raw or {}
    report, used = QuantizeReport(), set()
    if EMBEDDING in gguf_raw:
        from memwall.quant.embedding import QuantEmbedding
        embedding = QuantEmbedding(gguf_raw[EMBEDDING])
        _replace(model, EMBEDDING, embedding)
        report.embedding, used = embedding.source, {EMBEDDING}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        if name == "lm_head" and not include_lm_head:
            report.kept_float.append(name)
            continue
        new, source = _quantized(name, module, method, gguf_raw)
        if new is None:
            report.kept_float.append(name)
            continue
        _replace(model, name, new)
        used.add(name)
        report.quantized[name] = source
        report.float_bytes += module.weight.numel() * module.weight.element_size()
        report.quant_bytes += sum(b.numel() * b.element_size() for b in new.buffers())
    missing = set(gguf_raw) - used - ({"lm_head"} if not include_lm_head else set())
    if missing:
        raise ValueError(f"GGUF quantized weights {sorted(missing)[:3]} match no Linear of the "
                         f"model (they name the checkpoint's layers: quantize before "
                         f"fuse_projections() joins q/k/v and gate/up)")
    return report


def _quantized(name: str, linear: nn.Linear, method: QuantMethod | None,
               gguf_raw: dict[str, QuantWeights]) -> tuple[QuantLinear | None, str]:
    """(replacement module or None, its source)."""
    if name in gguf_raw:
        weights = gguf_raw[name]
        if (weights.out_features, weights.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(f"GGUF weight for {name!r} is {weights.out_features}x"
                             f"{weights.in_features}, the model's Linear is "
                             f"{linear.out_features}x{linear.in_features}")
        return QuantLinear(weights, linear.bias), weights.source
    if method is None or not method.supports(linear.out_features, linear.in_features):
        return None, ""
    weights = method.create_weights(linear.weight.detach())
    return QuantLinear(weights, linear.bias), weights.source


class ConcatLinear(nn.Module):
    """Several quantized Linears read as one: outputs side by side (a fused layer whose
    parts were stored in types that cannot share one kernel call)."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)  # [..., out]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def native_parts(self) -> "list[PackedWeight] | None":
        """Each part as memwall/kernels/cpu reads it, with its slice of the bias; None unless
        the kernels can read every part."""
        sizes = [p.out_features for p in self.parts]
        biases = (torch.split(self.bias.detach(), sizes) if self.bias is not None
                  else [None] * len(sizes))
        parts = [p.method.native_weight(p, b) for p, b in zip(self.parts, biases)]
        return None if any(w is None for w in parts) else parts


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def concat_quantized(parts: list[nn.Module]) -> nn.Module | None:
    """Quantized Linears with one input joined into one module whose outputs are theirs side by
    side (fusing q/k/v or gate/up after ``quantize_model``): one kernel call when their method
    can join the packed rows, else a ``ConcatLinear``. None unless every part is a QuantLinear."""
    if not all(isinstance(p, QuantLinear) for p in parts):
        return None
    weights = [_weights_of(p) for p in parts]
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(p.out_features)
                          for b, p in zip(biases, parts)])
    joined = weights[0].method.concat(weights)
    if joined is not None:
        return QuantLinear(joined, bias)
    return ConcatLinear([QuantLinear(w) for w in weights], bias)


def _weights_of(layer: QuantLinear) -> QuantWeights:
    return QuantWeights(layer.method, dict(layer.named_buffers(recurse=False)), layer.out_features,
                        layer.in_features, layer.source, layer.extra)
