"""elementwise.c's row-wise kernels as torch functions: RMSNorm (optionally after the residual
add), the MLP's gated activation, rotary embeddings in place. Callers (memwall/layers,
memwall/models) take them for float32 CPU tensors where ``usable`` says so and keep their
torch code for everything else (other dtypes, devices, autograd, MEMWALL_NATIVE=0)."""

from __future__ import annotations

import torch

from memwall.kernels.cpu import build

ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
"""The gated activations elementwise.c computes (the MLP's names)."""


def usable(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors outside autograd, and the native library built."""
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad
                for t in tensors) and build.available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x + residual (x itself when residual is None), normed =
    summed / sqrt(mean(summed^2) + eps) * weight, over the last dim. x, residual contiguous."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    if rows:
        build.require().mw_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                    weight.data_ptr(), out.data_ptr(),
                                    None if residual is None else summed.data_ptr(), rows, n, eps)
    return out, summed


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate columns first) -> act(gate) * up [T, I]; ``act`` one of ACTS."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=torch.float32)
    if rows and inter:
        gate_up = gate_up.contiguous()  # held here: C reads it after this line
        build.require().mw_gated_act(gate_up.data_ptr(), rows, inter, ACTS[act], out.data_ptr())
    return out


def rope_(tensors: tuple[torch.Tensor, ...], positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> bool:
    """Rotates each x [T, heads, head_dim] of ``tensors`` in place (rows may be strided: q and
    k as views of one qkv buffer) at ``positions`` with the float32 half tables cos, sin
    [max_positions, head_dim / 2]. All or none: False (nothing rotated) where any layout does
    not fit, so a caller's fallback never rotates a tensor twice."""
    if (positions.dtype != torch.int64 or positions.device.type != "cpu" or positions.dim() != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not (cos.is_contiguous() and sin.is_contiguous())):
        return False
    t = positions.shape[0]
    for x in tensors:
        if (x.dim() != 3 or x.shape[0] != t or x.stride(2) != 1 or x.stride(1) != x.shape[2]
                or x.shape[2] % 2 or cos.shape[1] * 2 != x.shape[2]):
            return False
    if t:
        positions = positions.contiguous()
        for x in tensors:
            rc = build.require().mw_rope(x.data_ptr(), x.stride(0), positions.data_ptr(), t,
                                         x.shape[1], x.shape[2], cos.data_ptr(), sin.data_ptr(),
                                         cos.shape[0])
            build.raise_for(rc, "rope")
    return True
