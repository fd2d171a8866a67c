"""SiLU-and-mul in Triton: the gated MLP's ``silu(gate) * up`` on the fused gate_up output.

    gate_up [T, 2I] = [ gate (I) | up (I) ]   ->   out [T, I] = silu(gate) * up

One read of gate_up and one write of out, instead of torch's three passes (silu, mul, and the
chunk's strided reads). Rounding follows torch: silu in float32 rounded to the input dtype, then
the product rounded again.
"""

import torch

from memwall.kernels.triton import require_triton, tl, triton

BLOCK = 1024
"""Columns per program."""


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """Grid (tokens, column blocks)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """gate_up: [..., 2I] -> [..., I]."""
    require_triton()
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be 2 x intermediate size, got {two_i}")
    inter = two_i // 2
    rows = gate_up.reshape(-1, two_i)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(inter))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            out, rows, rows.stride(0), out.stride(0), inter, BLOCK=block,
            num_warps=max(1, min(8, block // 256)),
        )
    return out.view(*gate_up.shape[:-1], inter)
