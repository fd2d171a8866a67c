"""memwall's own decoder layer (memwall/models/llama.py) with its matmuls and attention taken out,
for the calibration's ``layer_value_s``: what is left of a prefill chunk's layer (the norms,
rotary, the KV write, the activation, the residual adds) grows with the tokens and the layer's
width, H + I activation values a token; its matmuls and attention are measured apart.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

WIDTH = (1024, 16, 4, 64, 2816)  # hidden, heads, KV heads, head_dim, intermediate: a mid width


class _Measured(torch.nn.Module):
    """A projection (or attention) whose time is measured elsewhere: a fixed zero output."""

    def __init__(self, rows: int, *shape: int) -> None:
        super().__init__()
        self.out = torch.zeros(rows, *shape)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.out[: x.shape[0]]


class _KVWriteOnly:
    """An attention backend that writes K and V as the CPU backend does and attends nothing."""

    def __init__(self, out: _Measured) -> None:
        from memwall.attention.backend import get_backend

        self.cpu, self.forward = get_backend("cpu"), out.forward

    def write_kv(self, *args) -> None:
        self.cpu.write_kv(*args)


def value_probe(tokens: int) -> tuple[int, Callable[[], object]]:
    """(tokens x (H + I), a call that runs the layer on ``tokens`` tokens)."""
    from memwall.config import ModelArchConfig
    from memwall.layers.rotary import RotaryEmbedding
    from memwall.loader.model_loader import _skip_random_init
    from memwall.models.llama import DecoderLayer

    h, heads, kv, d, ffn = WIDTH
    cfg = ModelArchConfig("llama", 1, h, ffn, 1, heads, kv, d, 1e-5, 1e4, tokens, True)
    with _skip_random_init():  # its Linear weights are never used: leave them untouched
        layer = DecoderLayer(cfg)
    attention = layer.self_attn
    attention.qkv_proj = _Measured(tokens, (heads + 2 * kv) * d)
    attention.o_proj, layer.mlp.down_proj = _Measured(tokens, h), _Measured(tokens, h)
    layer.mlp.gate_up_proj = _Measured(tokens, 2 * ffn)
    attention.attn_backend = _KVWriteOnly(_Measured(tokens, heads, d))
    rope = RotaryEmbedding(d, tokens, 1e4, None).lookup(torch.arange(tokens), torch.float32)
    blocks = -(-tokens // 16)
    cache = (torch.zeros(blocks, 16, kv, d, dtype=torch.float16),
             torch.zeros(blocks, 16, kv, d, dtype=torch.float16))
    meta, x = SimpleNamespace(slot_mapping=torch.arange(tokens)), torch.randn(tokens, h)
    return tokens * (h + ffn), lambda: layer(x, rope, cache, meta)
