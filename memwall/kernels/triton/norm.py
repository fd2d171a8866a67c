"""RMSNorm in Triton, optionally fused with the residual add that precedes it in every layer.

A decoder layer reads ``h = x + residual`` and then normalizes it; fused, that is one pass over
the row instead of three (add, write, read back for the norm). Rounding follows the torch
layer (memwall/layers/norm.py) step by step: the sum is rounded to the activation dtype (that is
the residual stream), normalized in float32, rounded again, then scaled by the weight.
"""

import torch

from memwall.kernels.triton import require_triton, tl, triton


@triton.jit
def _rms_norm_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: [hidden] -> normed [hidden] (and the new residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's rounding
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x32 * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> RMSNorm(x) * weight, same shape and dtype as x."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., hidden] -> (RMSNorm(x + residual) * weight, x + residual).

    Out of place: both inputs are left as they were.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    return _launch(x, residual, weight, eps)


def _launch(x, residual, weight, eps):
    require_triton()
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    rows_in = x.reshape(-1, hidden)  # a view where strides allow, else a copy
    if rows_in.stride(-1) != 1:
        rows_in = rows_in.contiguous()
    out = torch.empty(rows_in.shape, dtype=x.dtype, device=x.device)
    res_in = res_out = out  # placeholders when there is no residual (never touched)
    if residual is not None:
        res_in = residual.reshape(-1, hidden).contiguous()
        res_out = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    if rows_in.shape[0]:
        _rms_norm_kernel[(rows_in.shape[0],)](
            out, res_out, rows_in, res_in, weight.contiguous(), rows_in.stride(0), res_in.stride(0),
            out.stride(0), res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    normed = out.view(x.shape)
    return normed, (res_out.view(x.shape) if residual is not None else None)
