"""Many-token q4/q8 matmuls on AMX at fp32 precision: split bf16 through oneDNN.

AMX tiles (Xeon Sapphire Rapids and later) multiply bf16 an order of magnitude faster than
AVX-512's fp32 FMAs, but one bf16 rounding of activations and weights (relative 2^-9) made
greedy tokens leave the exact path (79% of positions, quant_ops). So every operand is split,
a = hi + lo with hi = bf16(a) and lo = a - hi (split_bf16.c), and

    x . w  ~=  x_hi . w_hi  +  x_lo . w_hi  +  x_hi . w_lo        (x_lo . w_lo, ~2^-16, dropped)

three bf16 products with fp32 accumulation and an fp32 result: torch's fp32 ``F.linear`` in
oneDNN's bf16 math mode (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``), fed values
bf16 holds exactly (lo is rounded once more, to ~2^-17 of a). Relative error ~5e-6 against
float64 (the int16 activations of int_gemm.c: ~2e-5).

The weight is rebuilt from its codes for every call (8 bytes a value, never kept), which is why
this pays only past MIN_TOKENS tokens: prefill chunks, not decode.

``enabled()``: the CPU lists amx_bf16, torch has oneDNN, and a one-time probe measured the
split product faster than the kernel it replaces (the int16 panels where the build has AVX-512
VNNI, else the fp32 tiles); a VM that hides AMX state, or a CPU without it, keeps that kernel. ``MEMWALL_AMX=0`` turns it off, ``=1`` skips the probe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch

from memwall.kernels.cpu import build
from memwall.kernels.cpu.layout import check_packed, scale_format, table_ptr

logger = logging.getLogger("memwall")

# Below this many tokens the integer and fp32 tile kernels win: rebuilding the weight (8 bytes
# a value) costs more than the faster products save. Measured on a 2-core Xeon (Sapphire
# Rapids, AMX), SmolLM2's four projections of a layer, split bf16 vs fp32 tiles: 128 tokens
# 4.3 vs 4.2 ms, 256: 6.6 vs 8.5 ms, 512: 11.4 vs 17.1 ms.
MIN_TOKENS = 129
PROBE_SHAPE = (512, 1024, 1024)  # tokens, K, N: a prefill chunk's projection
PROBE_MIN_SPEEDUP = 1.2


def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _bf16_math():
    """oneDNN's fp32 matmuls compute in bf16 (fp32 accumulation and result) inside."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x -> (hi, lo): hi holds bf16(x), lo = x - hi, both float32."""
    x = x.contiguous()
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        build.require().mw_split_bf16(x.data_ptr(), x.numel(), hi.data_ptr(), lo.data_ptr())
    return hi, lo


def split_weight(kind: str, k: int, codes: torch.Tensor, s: torch.Tensor,
                 c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4/q8 weight rebuilt as s * q + c [N, K] and split (float32 hi, lo)."""
    n, group = check_packed(kind, k, codes, s, c)
    hi = torch.empty(n, k, dtype=torch.float32)
    lo = torch.empty(n, k, dtype=torch.float32)
    if n:
        lib = build.require()
        if kind == "q4":
            lib.mw_q4_dequant_split(codes.data_ptr(), s.data_ptr(), table_ptr(c), hi.data_ptr(),
                                    lo.data_ptr(), n, k, scale_format(s))
        else:
            lib.mw_q8_dequant_split(codes.data_ptr(), s.data_ptr(), table_ptr(c), hi.data_ptr(),
                                    lo.data_ptr(), n, k, group, scale_format(s))
    return hi, lo


def split_linear(x: torch.Tensor, w_hi: torch.Tensor, w_lo: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K], the weight's halves [N, K] -> x @ w.T float32 [M, N]."""
    x_hi, x_lo = split(x)
    with _bf16_math():
        # the two small terms first; addmm accumulates in place (no [2M, N] temporary, no
        # concatenated input: 10% faster than one call on stacked x_hi, x_lo)
        out = torch.nn.functional.linear(x_hi, w_lo)
        torch.addmm(out, x_lo, w_hi.t(), out=out)
        torch.addmm(out, x_hi, w_hi.t(), out=out)
    return out


def matmul(kind: str, x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor,
           c: torch.Tensor | None) -> torch.Tensor:
    """quant_ops.q4_matmul / q8_matmul through split bf16 (callers check ``use_for``)."""
    w_hi, w_lo = split_weight(kind, x.shape[-1], codes, s, c)
    return split_linear(x, w_hi, w_lo)


def use_for(tokens: int) -> bool:
    return tokens >= MIN_TOKENS and enabled()


@functools.cache
def enabled() -> bool:
    setting = os.environ.get("MEMWALL_AMX", "")
    if setting == "0" or not build.available() or not torch.backends.mkldnn.is_available():
        return False
    if setting == "1":
        return True
    if not cpu_has_amx_bf16():
        return False
    speedup = probe_speedup()
    on = speedup >= PROBE_MIN_SPEEDUP
    logger.info("AMX split-bf16 prefill matmuls %s (probe: %.1fx the kernel it replaces)",
                "on" if on else "off", speedup)
    return on


def probe_speedup() -> float:
    """The time of the kernel that runs without AMX (the int16 panels on AVX-512 VNNI, else the
    fp32 tiles) / split bf16's on PROBE_SHAPE (best of 3 each, after a warm-up)."""
    from memwall.kernels.cpu import quant_ops

    m, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.01
    c = -8 * s
    x = torch.randn(m, k, generator=g)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    if quant_ops.panels_available() and quant_ops.int_acts_enabled():
        other = best(lambda: quant_ops.native_gemm("q4", x, codes, s, c))
    else:
        other = best(lambda: quant_ops.tiles_matmul("q4", x, codes, s, c))
    return other / best(lambda: matmul("q4", x, codes, s, c))
