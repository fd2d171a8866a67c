"""Rotary position embedding in Triton: rotate-half (NeoX/HF) layout, in place on q and k.

The cos/sin tables are the ones ``memwall.layers.rotary.RotaryEmbedding`` builds, ``[max_positions,
head_dim / 2]``; the kernel looks up each token's row by position itself, so the per-step gather
and the rotation of every head of q and k are one launch. For one head, with h = head_dim / 2:

    out[:h] = x[:h] * cos - x[h:] * sin
    out[h:] = x[h:] * cos + x[:h] * sin

Rounding follows the torch layer (and HF): the tables are rounded to x's dtype and every
product and the sum are rounded to it too (emulated in float32, so 16-bit results match torch
bit for bit on the GPU; float32 is unaffected).
"""

import torch

from memwall.kernels.triton import require_triton, tl, triton


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin,
                  HALF: tl.constexpr, HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr):
    """Rotates every head of one token's row of x in place."""
    heads = tl.arange(0, HEADS_P2)
    cols = tl.arange(0, HALF_P2)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    first = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]  # [HEADS_P2, HALF_P2]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    out1 = (a * c).to(dt).to(tl.float32) - (b * s).to(dt).to(tl.float32)
    out2 = (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)
    tl.store(first, out1.to(dt), mask=mask)
    tl.store(first + HALF, out2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   num_q_heads, num_k_heads,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr,
                   Q_HEADS_P2: tl.constexpr, K_HEADS_P2: tl.constexpr):
    """One program per token: its cos/sin row is loaded once for all heads of q and k."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_P2)
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, HALF, Q_HEADS_P2, HALF_P2)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, HALF, K_HEADS_P2, HALF_P2)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place; returns them.

    cos, sin: [max_positions, head_dim / 2] tables; positions: [T] int. q and k may be strided
    views (e.g. slices of a fused qkv output) as long as their last dim is contiguous.
    """
    require_triton()
    tokens, _, head_dim = q.shape
    half = head_dim // 2
    if k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and an even head_dim")
    if cos.shape[-1] != half or sin.shape != cos.shape:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)}/{tuple(sin.shape)} must be "
                         f"[max_positions, {half}]")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (strides {t.stride()}): rotated in place")
    if tokens == 0:
        return q, k
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q.shape[1], k.shape[1],
        HALF=half, HALF_P2=triton.next_power_of_2(half),
        Q_HEADS_P2=triton.next_power_of_2(q.shape[1]), K_HEADS_P2=triton.next_power_of_2(k.shape[1]),
    )
    return q, k
