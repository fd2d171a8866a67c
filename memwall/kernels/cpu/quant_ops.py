"""The quantized matmuls of quant_gemm.c and int8_dot.c as torch functions, for weights in the
q4/q8 layouts of layout.py: ``x`` float32 [M, K] (contiguous) -> ``y`` float32 [M, N].

    M = 0            an empty [0, N], no C call (a prefill chunk that needs no logits)
    M = 1            the int8-activation kernels where the CPU has AVX512-VNNI and
                     ``set_int8_dot(True)`` (the default), else the exact fp32 row kernels
    M = 2..16        one pass of the fp32 row kernels over every weight row
    M > 16           16-token tiles, a tile per thread (AVX-512 builds); elsewhere the weight is
                     dequantized once and multiplied by BLAS
    K, N             K must fit the layout (a multiple of 32 for q4, of the group for q8);
                     anything else raises ValueError (layout.LayoutError) before C runs

Set MEMWALL_NATIVE=0 to turn the kernels off (``available()`` is then False and memwall/quant
uses torch's ops instead).
"""

from __future__ import annotations

import ctypes

import torch

from memwall.kernels.cpu import build
from memwall.kernels.cpu.build import available
from memwall.kernels.cpu.layout import check_input, check_packed

MAX_TOKENS = 16  # MW_MAX_ROWS in kernels.h: larger batches go in tiles of this many tokens

__all__ = ["MAX_TOKENS", "available", "int8_dot_available", "q4_dequantize", "q4_matmul",
           "q8_dequantize", "q8_matmul", "set_int8_dot"]


def _lib() -> ctypes.CDLL:
    return build.require()


def set_int8_dot(on: bool) -> None:
    """One-token matmuls with int8-quantized activations (fast, llama.cpp's numerics) or on the
    exact fp32 kernels. Where the CPU lacks AVX512-VNNI the fp32 kernels always run."""
    _lib().mw_set_int8_dot(int(on))


def int8_dot_available() -> bool:
    return available() and bool(_lib().mw_int8_dot_available())


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] with the q4 layout's weight."""
    return _matmul("q4", x, codes, s, c)


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] with the q8 layout's weight."""
    return _matmul("q8", x, codes, s, c)


def _matmul(kind: str, x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor,
            c: torch.Tensor) -> torch.Tensor:
    """One token: the int8-digit gemv where the CPU has it; 2..16: the row kernels; more: the
    16-token tiles (or, where they are not built, the dequantized weight and BLAS)."""
    k = x.shape[-1]
    n, group = check_packed(kind, k, codes, s, c)
    check_input(x, k, f"{kind}_matmul")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return y
    lib = _lib()
    tiles, gemv, gemm = ((lib.q4_gemm_tiles, lib.mw_q4_gemv_i8, lib.q4_gemm) if kind == "q4"
                         else (lib.q8_gemm_tiles, lib.mw_q8_gemv_i8, lib.q8_gemm))
    grouped = () if kind == "q4" else (group,)  # q4's blocks are always 32 wide
    args = (*grouped, codes.data_ptr(), s.data_ptr(), c.data_ptr(), y.data_ptr(), n)
    if m > MAX_TOKENS:
        if tiles(x.data_ptr(), m, k, *args):
            return y
        weight = q4_dequantize(codes, s, c, k) if kind == "q4" else q8_dequantize(codes, s, c)
        return _big_linear(x, weight)
    if m == 1 and gemv(x.data_ptr(), k, *args):
        return y
    gemm(x.data_ptr(), m, k, *args)
    return y


def _big_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Many tokens where the tile kernels are not built (no AVX-512): the weight as fp32 and
    BLAS. (bf16 ran 4x faster on AVX512-BF16 CPUs, but greedy tokens then agreed with the float
    path on only 79% of positions.)"""
    return torch.nn.functional.linear(x, w)


def q4_dequantize(codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
    """The q4 weight as float32 [N, K], each value s * q + c as the reference computes it."""
    n, _ = check_packed("q4", k, codes, s, c)
    w = torch.empty(n, k, dtype=torch.float32)
    if n:
        _lib().q4_dequant(codes.data_ptr(), s.data_ptr(), c.data_ptr(), w.data_ptr(), n, k)
    return w


def q8_dequantize(codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The q8 weight as float32 [N, K]."""
    k = codes.shape[-1]
    n, group = check_packed("q8", k, codes, s, c)
    w = torch.empty(n, k, dtype=torch.float32)
    if n:
        _lib().q8_dequant(codes.data_ptr(), s.data_ptr(), c.data_ptr(), w.data_ptr(), n, k, group)
    return w
