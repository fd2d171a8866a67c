"""Weight-only FP8 matmul for few rows (decode): y[M, N] = x[M, K] @ (q[N, K] * scale[N])^T.

    q: float8_e4m3fn [N, K], one float32 scale per output channel (memwall/quant/fp8.py)
    x: bf16 / fp16 / fp32 [M, K]; products accumulated in fp32; y in x.dtype

Why a kernel of our own: at decode M is the batch (1..32 tokens), so the matmul is a stream of
the weight bytes with a few FLOPs per byte. ``torch._scaled_mm`` (fp8 x fp8 tensor cores) first
needs the activations quantized (several small launches per Linear) and its tiles are sized
for large M; measured on an H100 it reached 29% of the copy rate at B=1, slower than bf16
weights. Here the weights are read once for all M rows and widened to float in registers (x is
not quantized at all: the only rounding is the weights' own), so the kernel can run at the
memory rate, and it also runs where there are no FP8 tensor cores.

Two inner loops, chosen by the row count (``pick_config``):

    M == 1     GEMV: a [BLOCK_N, BLOCK_K] weight tile times the x row, products kept in a 2-D
               fp32 accumulator and reduced across K once at the end (no shuffles in the loop)
    M >= 2     tl.dot, "swapped": acc[BLOCK_N, BLOCK_M] += w[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K,
               BLOCK_M], so the wide N side is the MMA's M and the few tokens (padded to 16 or
               32, tl.dot's minimum is 16) its N. At 16 rows the CUDA-core FMAs of a GEMV would
               cost ~16 per weight byte, more than the SM can issue at the memory rate.

Split-K: with N / BLOCK_N tiles alone, N = 1024 (k/v projections) or 4096 would give one or two
programs per SM, too few loads in flight to reach the memory rate. ``split_k`` programs then
share a tile's K range and write fp32 partials [split_k, M, N]; a second small kernel sums them
in a fixed order, scales and casts. Deterministic (no atomics): the same input gives the same
bits whatever the scheduling, which greedy decoding and the tests rely on.

Reading the FP8 bytes: Triton only accepts the ``float8e4nv`` type on compute capability >= 8.9.
The weight is always passed as uint8; on >= 8.9 it is bitcast to float8e4nv in registers and
widened by the hardware's conversion, below that decoded with integer ops (``_e4m3_to_f16``):
the byte's 7 magnitude bits shifted into fp16's exponent and mantissa give the value times 2^-8
(subnormals included), and the 2^8 is folded into the per-channel scale. NaN bytes (0x7F/0xFF,
which quantize_fp8_rows never writes) decode to +-480 there, NaN on the native path.

Tiles come from a fixed table (``pick_config``), never from run-time autotuning: the CUDA-graph
capture of a decode step must launch exactly what eager mode launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from memwall.kernels.triton import require_triton, tl, triton

SPLIT_K_MIN_K = 8192
"""Split-K only from this many inputs. Measured on an H100 (2026-11-26, bf16 x, ms, split 1 vs
the best split): K = 4096 never gained more than 10% (6144x4096 at M = 16: 0.0254 vs 0.0229)
and 4096x4096 lost badly (M = 1: 0.0149 at split 1, 0.072 at split 2; M = 16: 0.0234 vs 0.053
at 8); K = 14336 gained (4096x14336, M = 1: 0.042 vs 0.037 at 2; M = 16: 0.068 vs 0.043 at 4)."""
MIN_K_STEPS = 2
"""A split-K share holds at least this many BLOCK_K steps (shorter ones are all prologue)."""
PROGRAMS_PER_SM = 4
"""Split-K aims at this many programs per SM: several resident programs keep enough weight
loads in flight to cover the memory latency (Triton software-pipelines the loads that feed
tl.dot through shared memory; the GEMV loop's plain loads get no such prefetch)."""
PARTIAL_TRAFFIC = 4
"""Split-K's fp32 partials (written, then read back) may add at most 1/PARTIAL_TRAFFIC of the
weight bytes: at M = 16 and K = 4096 that caps split_k at 8. Loose, because a few MiB of
partials mostly stay in L2 (50 MiB on an H100) rather than costing HBM bandwidth."""


@dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int  # rows per program: 1 selects the GEMV loop, 16 or 32 the tl.dot loop
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _e4m3_to_f16(b):
    """uint8 E4M3 bytes -> fp16 of the value times 2^-8, exact (subnormals too): E4M3's 4
    exponent bits (bias 7) land in fp16's 5 (bias 15), its 3 mantissa bits atop fp16's 10."""
    h = b.to(tl.uint16)
    bits = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP8_NATIVE: tl.constexpr, PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (n tile, K share, m tile). PARTIAL: write unscaled fp32 sums to out[pid_k]
    (split-K); else scale, cast to out's dtype and store the final rows."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    ks = tl.arange(0, BLOCK_K)
    # 64-bit row offsets: N * K passes 2^31 for the largest models' MLP weights
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + ks)[None, :] * stride_wk
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + (k_start + ks) * stride_xk
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        # x^T [BLOCK_K, BLOCK_M]: rows past M load zeros and are never stored
        x_ptrs = (x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
                  + (k_start + ks)[:, None] * stride_xk)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        # the bytes load as uint8 (a zero ``other`` needs no float-to-fp8 cast): a masked-off
        # weight must be 0, not garbage, since garbage NaN times a zero x is NaN
        if EVEN_K:  # every share is whole BLOCK_K steps: no K mask, so the loads vectorize
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            k_ok = (k0 + ks) < k_stop
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        if FP8_NATIVE:
            w = w.to(tl.float8e4nv, bitcast=True)
        else:
            w = _e4m3_to_f16(w)  # value * 2^-8; the scale below carries the 2^8
        if BLOCK_M == 1:
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            # E4M3 (and the 2^-8 fp16 form) widen exactly to bf16/fp16/fp32: only the fp32
            # accumulation rounds, as in the float reference
            w = w.to(x.dtype)
            if DOT_FP32:  # the interpreter's dot takes bf16 as raw uint16: same products in fp32
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    out_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[None, :] * stride_om
                + offs_n[:, None])
    out_mask = n_ok[:, None] & m_ok[None, :]
    if PARTIAL:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
        if not FP8_NATIVE:
            scale = scale * 256.0
        tl.store(out_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(part_ptr, scale_ptr, out_ptr, M, N, stride_ps, stride_om,
                           SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """out[m, n] = (sum over s of part[s, m, n], in order s = 0, 1, ...) * scale[n]."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    ok = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * N + offs_n, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + offs_n, mask=ok, other=0.0)
    if not FP8_NATIVE:
        scale = scale * 256.0
    tl.store(out_ptr + m * stride_om + offs_n, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------------

# (block_m, block_n, block_k, num_warps, num_stages) by row count. Weight bytes per loop step:
# GEMV 16 x 512 = 8 KiB (64 B, four 16-byte loads, per thread of 4 warps; the 2-D accumulator
# is 64 fp32 registers); dot 64 x 128 = 8 KiB, pipelined 4 deep through shared memory.
_GEMV = (1, 16, 512, 4, 2)
_DOT16 = (16, 64, 128, 4, 4)
_DOT32 = (32, 64, 128, 4, 4)


@lru_cache(maxsize=1024)  # eager decode asks again for every Linear of every step
def pick_config(m: int, n: int, k: int, sms: int) -> Fp8LinearConfig:
    """The tiles for an [m, k] x [n, k]^T product on a GPU with ``sms`` multiprocessors.

    Tile shape by m (the table above); split_k, a power of two, as large as it may be while
    (1) the grid stays within PROGRAMS_PER_SM programs per SM, (2) each share keeps at least
    MIN_K_STEPS BLOCK_K steps, (3) the partials add at most 1/PARTIAL_TRAFFIC of the weight
    bytes, (4) K >= SPLIT_K_MIN_K. Llama-3-8B on 132 SMs (N x K): qkv 6144x4096, o 4096x4096
    and gate_up 28672x4096 -> 1; down 4096x14336 -> 2 at M = 1, 8 at M = 16 and 32.
    """
    block_m, block_n, block_k, warps, stages = _GEMV if m == 1 else _DOT16 if m <= 16 else _DOT32
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))  # no all-masked steps for tiny K
    tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
    k_steps = math.ceil(k / block_k)
    split = 1
    while (k >= SPLIT_K_MIN_K and tiles * split * 2 <= PROGRAMS_PER_SM * sms
           and k_steps >= 2 * split * MIN_K_STEPS
           and 2 * split * m * 4 * 2 * PARTIAL_TRAFFIC <= k):  # partial bytes per weight byte
        split *= 2
    return Fp8LinearConfig(block_m, block_n, block_k, split, warps, stages)


@lru_cache(maxsize=None)
def _cuda_info(index: int) -> tuple[int, bool]:
    """(multiprocessors, float8e4nv readable) of a CUDA device, looked up once: the launcher
    runs per Linear per step in eager decode."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, (props.major, props.minor) >= (8, 9)


def _device_info(device: torch.device) -> tuple[int, bool]:
    if device.type != "cuda":  # the interpreter: a fixed SM count keeps the tiles reproducible
        return 132, True
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())


def fp8_native(device: torch.device) -> bool:
    """Whether triton may read float8e4nv here (CUDA >= 8.9; the interpreter reads it too)."""
    return _device_info(device)[1]


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, *,
               config: Fp8LinearConfig | None = None, native: bool | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] float8_e4m3fn * wscale [N] float32)^T -> [..., N] in x.dtype.

    ``config`` None picks tiles from the device (``pick_config``); ``native`` None reads the
    bytes as float8e4nv where triton allows it, else decodes them from uint8 (``False`` forces
    the decode, which the tests use to check it anywhere).
    """
    require_triton()
    n, k = qweight.shape
    if qweight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"qweight must be float8_e4m3fn, got {qweight.dtype}")
    if x.shape[-1] != k or wscale.shape != (n,):
        raise ValueError(f"x [..., {k}] and wscale [{n}] expected for a {n}x{k} weight, got "
                         f"x {tuple(x.shape)}, wscale {tuple(wscale.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out.reshape(*lead, n)
    sms, can_read_fp8 = _device_info(x.device)
    cfg = config or pick_config(m, n, k, sms)
    native = can_read_fp8 if native is None else native
    w = qweight.view(torch.uint8)  # FP8_NATIVE bitcasts it back to float8e4nv in registers
    scale = wscale.float().contiguous()
    # every share a whole number of BLOCK_K steps, so only the last one can end short
    k_per_split = math.ceil(math.ceil(k / cfg.block_k) / cfg.split_k) * cfg.block_k
    split = math.ceil(k / k_per_split)  # shares past K would be empty
    even_k = k % cfg.block_k == 0
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit x
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=even_k,
                  FP8_NATIVE=native, DOT_PRECISION=precision,
                  DOT_FP32=x.device.type == "cpu",  # CPU tensors: triton's interpreter
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split == 1:
        _fp8_linear_kernel[grid](x2, w, scale, out, m, n, k, k_per_split,
                                 x2.stride(0), x2.stride(1), w.stride(0), w.stride(1),
                                 0, out.stride(0), PARTIAL=False, **common)
    else:
        part = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        _fp8_linear_kernel[grid](x2, w, scale, part, m, n, k, k_per_split,
                                 x2.stride(0), x2.stride(1), w.stride(0), w.stride(1),
                                 part.stride(0), part.stride(1), PARTIAL=True, **common)
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            part, scale, out, m, n, part.stride(0), out.stride(0),
            SPLIT_K=split, BLOCK=block, FP8_NATIVE=native, num_warps=4)
    return out.reshape(*lead, n)


__all__ = ["Fp8LinearConfig", "fp8_linear", "fp8_native", "pick_config"]
