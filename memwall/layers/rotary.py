"""Rotary position embedding (RoPE), rotate-half (NeoX/HF) layout, with Llama-3 frequency scaling.

The cos/sin table is built once for all positions up to the context window; a step looks up
the rows of its tokens' positions, so any mix of prefill chunks and decodes costs one gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from memwall.kernels.cpu import elementwise


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's wavelength-dependent scaling: long wavelengths are slowed by ``factor``."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


SUPPORTED_ROPE_SCALING = ("default", "llama3", "linear")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = (
            head_dim, max_positions, theta, scaling)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)computes the tables: at construction, and after a model built on the meta
        device is materialized with ``to_empty`` (which leaves buffers uninitialized)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)  # [head_dim / 2]
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        # Half-width tables (what kernels read), and full-width ones with rotate-half's sign
        # folded into sin for the torch path: x * cos + swap_halves(x) * sin is four cheap ops.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("cos_full", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def truncate(self, max_positions: int) -> None:
        """Keeps the tables' first ``max_positions`` rows (the engine's context window): a
        32k-position table of head_dim 256 is 84 MB, most of it never read."""
        if max_positions >= self.max_positions:
            return
        self.max_positions = max_positions
        for name in ("cos", "sin", "cos_full", "sin_signed"):
            setattr(self, name, getattr(self, name)[:max_positions].clone())

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeRows":
        """The step's rows of the tables (done once per forward pass: every layer rotates at
        the same positions)."""
        return RopeRows(self, positions, dtype)

    @staticmethod
    def apply(rows: "RopeRows | tuple[torch.Tensor, torch.Tensor]", q: torch.Tensor,
              k: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; returns both rotated.
        float32 CPU q and k outside autograd are rotated in place by
        memwall/kernels/cpu/elementwise.c (they are fresh projection outputs); else torch."""
        if (isinstance(rows, RopeRows) and rows.dtype == torch.float32 and elementwise.usable(q, k)
                and elementwise.rope_((q, k), rows.positions, rows.table.cos, rows.table.sin)):
            return q, k
        cos, sin = rows  # a RopeRows gathers its full-width rows here
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RopeRows:
    """A step's positions against one RotaryEmbedding: the native path reads the half tables
    at the positions itself; the torch path gathers full-width cos and sin rows
    [tokens, 1, head_dim] in ``dtype`` once, on first use (as HF does: the tables are
    float32, the rotation runs in the activations' dtype)."""

    def __init__(self, table: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.table, self.positions, self.dtype = table, positions, dtype
        self._full: tuple[torch.Tensor, torch.Tensor] | None = None

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None:
            self._full = (self.table.cos_full[self.positions].unsqueeze(1).to(self.dtype),
                          self.table.sin_signed[self.positions].unsqueeze(1).to(self.dtype))
        return self._full

    def __iter__(self):  # cos, sin = rows (the tuple lookup() returned before)
        return iter(self.full())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # sin carries the minus sign
    return x * cos + swapped * sin
