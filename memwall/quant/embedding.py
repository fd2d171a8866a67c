"""``QuantEmbedding``: a token embedding whose table stays quantized; a lookup dequantizes only
the rows it reads.

A GGUF file stores ``token_embd.weight`` quantized like any other weight. Dequantized to float32
it is the largest tensor of a small model (SmolLM2-135M: 49152 x 576 = 113 MB, more than all
its quantized Linears together), yet a step reads only one row per token. So the table is kept
in the layout of the native kernels (memwall/quant/int4_cpu.py ``NativeQ4``, int8_cpu.py
``NativeQ8``) and a tied model's embedding shares the very buffers of its quantized lm_head.

    NativeQ4  codes uint8 [V, H/2]: per 32-value block, byte j = q[j] | q[j+16] << 4
    NativeQ8  codes int8  [V, H]
    both      s, c [V, H/G] tables:   row value = s * q + c  (G = 32, or 16 for Q6_K); float32,
              float16, or two-level for K-quants (memwall/kernels/cpu/layout.py)

When the tied head is packed into 16-row panels (memwall/quant/packing.py permutes the shared
tensors in place), ``read_panels`` switches the lookup to the panels' row reader.

Rows are rebuilt with the arithmetic of the GGUF reference dequantizer (one fp32 multiply and
one add; for GGUF types the product is exact), so a lookup equals the float table's rows bit for
bit (tests/quant/test_quant_embedding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from memwall.kernels.cpu import panels
from memwall.kernels.cpu.layout import PackedWeight, float_table
from memwall.quant.base import QuantWeights
from memwall.quant.int4_cpu import NativeQ4
from memwall.quant.int8_cpu import NativeQ8


class QuantEmbedding(nn.Module):
    """Drop-in for ``nn.Embedding`` (forward only): ``ids [...] -> [..., H]`` float32."""

    def __init__(self, weights: QuantWeights) -> None:
        super().__init__()
        if not self.supports(weights):
            raise ValueError(f"QuantEmbedding holds NativeQ4/NativeQ8 weights, not "
                             f"{type(weights.method).__name__} ({weights.source})")
        self.four_bit = isinstance(weights.method, NativeQ4)
        self.num_embeddings, self.embedding_dim = weights.out_features, weights.in_features
        self.source = weights.source
        for name in ("codes", "s", "c"):  # shared, not copied: a tied lm_head holds the same ones
            self.register_buffer(name, weights.tensors[name])
        self.panels: PackedWeight | None = None  # set by read_panels

    @staticmethod
    def supports(weights: QuantWeights) -> bool:
        return type(weights.method) in (NativeQ4, NativeQ8)

    def read_panels(self, weight: PackedWeight) -> None:
        """Our tensors were packed in place as ``weight`` (the tied head's): read rows there."""
        if weight.codes.data_ptr() != self.codes.data_ptr():
            raise ValueError("read_panels: the packed weight is not this embedding's table")
        self.panels = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panels.rows(self.panels, ids)
        flat = ids.reshape(-1)
        rows = self.codes.index_select(0, flat)  # [T, H/2] uint8 or [T, H] int8
        if self.four_bit:
            b = rows.view(len(flat), -1, 1, 16)  # [T, H/32, 1, 16]
            q = torch.cat([b & 0x0F, b >> 4], dim=2).view(len(flat), -1)  # [T, H]
        else:
            q = rows
        s = float_table(self.s.index_select(0, flat))  # [T, H/G] (every format widens exactly)
        c = float_table(self.c.index_select(0, flat))
        groups = s.shape[1]
        w = q.float().view(len(flat), groups, -1) * s[..., None] + c[..., None]  # [T, H/G, G]
        return w.view(*ids.shape, self.embedding_dim)

    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, source={self.source!r}"
