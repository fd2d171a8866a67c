"""The quantized matmuls of quant_gemm.c, int_gemm.c, int8_dot.c and int8_tiles.c as torch
functions, for weights in the q4/q8 layouts of layout.py: ``x`` float32 [M, K] (contiguous) ->
``y`` float32 [M, N]. (On AVX-512 VNNI CPUs the loaded model's weights are packed into 16-row
panels and multiplied by panels.py instead; these serve the row layout everywhere else.)

    M = 0            an empty [0, N], no C call (a prefill chunk that needs no logits)
    M = 1..8         on AVX512-VNNI: int8_dot.c's two int8 digits a value, each row as that
                     token alone gets it (batch-invariant: speculative verification reproduces
                     one-token decoding); elsewhere as below
    M > 8            on AVX512-VNNI: int16 activations with 16 output rows across the lanes
                     (panel_gemm.c) at any size, while integer activations are on (K-quants and
                     Q5_0 / Q5_1 take int8_tiles.c first, as below)
    M = 1..256       int16 activations (int_gemm.c: AVX2 vpmaddwd, AVX-512 VNNI vpdpwssd, plain
                     C; AVX-512 builds: below ``tiles_from()``, 16 tokens a thread, from there
                     the exact fp32 tiles, which are faster) while ``set_int_acts(True)`` (the
                     default); else the exact fp32 row kernels
    M > 16           K-quant weights (two-level tables: Q4_K, Q5_K, Q6_K), q8 weights with a
                     float scale a 32-value block whose codes span at most 64 values (Q5_0,
                     Q5_1; Q8_0 stays int16, even past INT_ACTS_MAX_TOKENS; with
                     ``set_int8_tiles(True, q4_float_tables=True)`` also Q4_0/Q4_1) on AVX2:
                     int8_tiles.c, one int8 a value (a scale per 256 values, per 32 for float
                     tables), at any size (but AMX's, below) while integer activations and
                     ``set_int8_tiles`` are on
    M > 128          split bf16 on AMX (amx.py: three bf16 products, fp32 precision) where the
                     CPU has AMX and a probe measured it faster; else 16-token fp32 tiles, a tile
                     per thread (AVX-512 builds); elsewhere the weight is dequantized once and
                     multiplied by BLAS
    K, N             K must fit the layout (a multiple of 32 for q4, of the group for q8);
                     anything else raises ValueError (layout.LayoutError) before C runs

Set MEMWALL_NATIVE=0 to turn the kernels off (``available()`` is then False and memwall/quant
uses torch's ops instead).
"""

from __future__ import annotations

import ctypes

import torch

from memwall.kernels.cpu import amx, build
from memwall.kernels.cpu.build import available
from memwall.kernels.cpu.layout import check_input, check_packed, scale_format, table_ptr

MAX_TOKENS = 16  # MW_MAX_ROWS in kernels.h: larger batches go in tiles of this many tokens
# Up to this many tokens the int16 kernels beat dequantize + BLAS; past it fp32 BLAS (near the
# FMA peak on large batches) wins on long rows. Measured on a 2-core AMD EPYC (Zen 3, AVX2), 2
# threads, Q8_0-shaped q8 (fp16 scales) 4864x896 / 896x4864 / 896x896 / 128x896: at 144 tokens
# int16 took 0.56-0.82x BLAS's time, at 256 0.65-1.06x (0.77x summed over the four), at 512
# 0.80-1.32x. (int8_tiles.c's formats take the integer kernels at every size.)
INT_ACTS_MAX_TOKENS = 256

__all__ = ["INT_ACTS_MAX_TOKENS", "MAX_TOKENS", "available", "int8_dot_available", "int_acts_enabled",
           "int8_tiles_enabled", "int_gemm_isa", "native_gemm", "panels_available", "q4_dequantize", "q4_matmul",
           "q8_dequantize", "q8_matmul", "set_int8_tiles", "set_int_acts"]


def _lib() -> ctypes.CDLL:
    return build.require()


def set_int_acts(on: bool) -> None:
    """q4/q8 matmuls of up to INT_ACTS_MAX_TOKENS tokens with integer activations (int16 a
    value, a scale per 32: relative error ~2e-5; the default) or on the exact fp32 kernels (the
    reference for quality checks). Every CPU has the integer path (AVX2, VNNI or plain C)."""
    _lib().mw_set_int_acts(int(on))


def set_int8_tiles(on: bool, q4_float_tables: bool = False) -> None:
    """Prefill matmuls (more than 16 tokens) on K-quant weights and on q8 weights with float
    block scales and narrow codes (Q5_0, Q5_1) with int8 activations (on: the default; llama.cpp's
    precision) or with int_gemm.c's int16 ones; q4_float_tables: Q4_0/Q4_1 too (off by default:
    SmolLM2-135M Q4_1's greedy tokens agreed on 87.9% of positions)."""
    _lib().mw_set_int8_tiles(2 if on and q4_float_tables else int(on))


def int8_tiles_enabled() -> bool:
    return available() and bool(_lib().mw_int8_tiles_on())


def int_acts_enabled() -> bool:
    return available() and bool(_lib().mw_int_acts_on())


def int_gemm_isa() -> str:
    """Which integer-activation code path this build runs: "vnni", "avx2" or "c"."""
    return {3: "vnni", 2: "avx2"}.get(_lib().mw_int_gemm_isa(), "c")


def tiles_from() -> int:
    """The batch size from which q4/q8 matmuls take the exact fp32 tiles even with integer
    activations on (AVX-512 builds: a full 16-token tile for every thread, where the tiles are
    faster), or 0 where they never do."""
    return int(_lib().mw_tiles_from())


def int8_dot_available() -> bool:
    return available() and bool(_lib().mw_int8_dot_available())


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] with the q4 layout's weight."""
    return _matmul("q4", x, codes, s, c)


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] with the q8 layout's weight; ``c`` None: its
    offsets are all zero, and the kernels do not read them (layout.py)."""
    return _matmul("q8", x, codes, s, c)


def _matmul(kind: str, x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor,
            c: torch.Tensor | None) -> torch.Tensor:
    """Past amx.MIN_TOKENS: split bf16 on AMX (amx.py) where it is faster and integer
    activations are on. Else up to INT_ACTS_MAX_TOKENS, and at any size where panel_gemm.c
    (AVX-512 VNNI) or int8_tiles.c (the weight's format: K-quants, Q5_0/Q5_1) takes it:
    q4_gemm / q8_gemm, which run the integer kernels while on (else the exact fp32 row
    kernels); else the fp32 tiles (``tiles_matmul``)."""
    k = x.shape[-1]
    n, group = check_packed(kind, k, codes, s, c)
    check_input(x, k, f"{kind}_matmul")
    m = x.shape[0]
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=torch.float32)
    lib = _lib()
    int_acts = bool(lib.mw_int_acts_on())
    fmt = scale_format(s)
    if int_acts and amx.use_for(m):  # past amx.MIN_TOKENS, where the probe measured it faster
        return amx.matmul(kind, x, codes, s, c)
    small = m <= (INT_ACTS_MAX_TOKENS if int_acts else MAX_TOKENS)
    # int8_tiles.c beat dequantize + BLAS at every prefill size measured (AMD EPYC Zen 3: 1.4-2.1x
    # the int16 kernels, 0.4-0.7x BLAS's time at 512 tokens), and panel_gemm.c's int16 panels
    # (AVX-512 VNNI) ran at 3.1x the fp32 tiles on 480 tokens (AMD EPYC Zen 4), so their
    # formats skip the BLAS copy
    if small or (int_acts and (panels_available() or
                               lib.mw_int8_tiles_fit(int(kind == "q4"), k, group, fmt))):
        return _gemm(kind, x, k, n, group, codes, s, c, fmt)
    return tiles_matmul(kind, x, codes, s, c)


def panels_available() -> bool:
    """Whether this build has panel_gemm.c's AVX-512 VNNI kernels (more than 8 tokens)."""
    return available() and bool(_lib().mw_panel_available())


def native_gemm(kind: str, x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor,
                c: torch.Tensor | None) -> torch.Tensor:
    """q4_gemm / q8_gemm: the C library's own choice of kernel for this batch (int8 digits, int8
    tiles, int16 panels or rows, fp32 tiles, exact rows; more than MAX_TOKENS tokens only with
    integer activations). Unchecked: callers checked the layout."""
    k = x.shape[-1]
    n, group = check_packed(kind, k, codes, s, c)
    return _gemm(kind, x, k, n, group, codes, s, c, scale_format(s))


def _gemm(kind: str, x: torch.Tensor, k: int, n: int, group: int, codes: torch.Tensor,
          s: torch.Tensor, c: torch.Tensor | None, fmt: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    gemm = _lib().q4_gemm if kind == "q4" else _lib().q8_gemm
    grouped = () if kind == "q4" else (group,)  # q4's blocks are always 32 wide
    gemm(x.data_ptr(), x.shape[0], k, *grouped, codes.data_ptr(), s.data_ptr(), table_ptr(c),
         y.data_ptr(), n, fmt)
    return y


def tiles_matmul(kind: str, x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor,
                 c: torch.Tensor | None) -> torch.Tensor:
    """Any number of tokens in fp32: the 16-token tiles (AVX-512 builds), else the dequantized
    weight and BLAS. Unchecked: callers checked the layout."""
    k = x.shape[-1]
    n, group = check_packed(kind, k, codes, s, c)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib = _lib()
    tiles = lib.q4_gemm_tiles if kind == "q4" else lib.q8_gemm_tiles
    grouped = () if kind == "q4" else (group,)
    if tiles(x.data_ptr(), x.shape[0], k, *grouped, codes.data_ptr(), s.data_ptr(),
             table_ptr(c), y.data_ptr(), n, scale_format(s)):
        return y
    weight = q4_dequantize(codes, s, c, k) if kind == "q4" else q8_dequantize(codes, s, c)
    return _big_linear(x, weight)


def _big_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Many tokens where the tile kernels are not built (no AVX-512): the weight as fp32 and
    BLAS. (bf16 ran 4x faster on AVX512-BF16 CPUs, but greedy tokens then agreed with the float
    path on only 79% of positions.)"""
    return torch.nn.functional.linear(x, w)


def q4_dequantize(codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor | None, k: int) -> torch.Tensor:
    """The q4 weight as float32 [N, K], each value s * q + c as the reference computes it."""
    n, _ = check_packed("q4", k, codes, s, c)
    w = torch.empty(n, k, dtype=torch.float32)
    if n:
        _lib().q4_dequant(codes.data_ptr(), s.data_ptr(), table_ptr(c), w.data_ptr(), n, k,
                          scale_format(s))
    return w


def q8_dequantize(codes: torch.Tensor, s: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """The q8 weight as float32 [N, K]."""
    k = codes.shape[-1]
    n, group = check_packed("q8", k, codes, s, c)
    w = torch.empty(n, k, dtype=torch.float32)
    if n:
        _lib().q8_dequant(codes.data_ptr(), s.data_ptr(), table_ptr(c), w.data_ptr(), n, k, group,
                          scale_format(s))
    return w
