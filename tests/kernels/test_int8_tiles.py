"""int8_tiles.c: prefill matmuls with int8 activations on K-quant weights (two-level tables)
and on q4 weights with float scales (Q4_0 / Q4_1).

The reference here quantizes the activations the way the kernel is documented to (one int8 a
value, a scale max|x| / 127 per token and 256-value superblock, or per 32-value block for float
tables, round half to even) and then
computes in float64, so the integer arithmetic (codes, sub-scales, sign trick, no int16
saturation at the code extremes) is checked exactly; the offset term multiplies the same rounded
activations (their group sums).
Batch sizes cross the 8-token tile and the MW_I8T_MIN_TOKENS limit (decode batches stay off
this path), row counts cross the 16-row chunk, and every instruction-set build runs (only AVX2
builds take the path; the others must give int_gemm.c's result).
"""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import build, quant_ops
from memwall.kernels.cpu.layout import float_table, two_level_table

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")

SUPER = 256
MIN_TOKENS = 16  # kernels.h MW_I8T_MIN_TOKENS: at most this many tokens never take the path
TOKENS = [17, 23, 24, 25, 40, 129]  # just past the limit, around 8-token tiles, past 128
# kind, K, group, table format (layout.scale_format: sub-scales a superblock, 1 fp16, 0 fp32):
# Q4_K, Q5_K (q8 codes, 32-value groups), Q6_K, then Q4_1 / Q4_0-like float tables (K off 256)
KQUANTS = [("q4", 256, 32, 8), ("q4", 768, 32, 8), ("q8", 512, 32, 8), ("q8", 256, 16, 16),
           ("q8", 2304, 16, 16), ("q4", 128, 32, 1), ("q4", 640, 32, 1), ("q4", 1152, 32, 0),
           ("q4", 576, 32, 1), ("q4", 64, 32, 0),  # K % 128 = 64: a last half quad (SmolLM2's 576)
           # q8 codes with float tables (Q8_0's full range: back to int16; Q5_0 / Q5_1 spans of
           # 32 shifted to unsigned), K crossing whole quads and half quads (Gemma 3's 640)
           ("q8", 640, 32, 1), ("q8", 576, 32, 1), ("q8", 1152, 32, 0),
           ("q5_0", 640, 32, 1), ("q5_0", 896, 32, 1), ("q5_0", 576, 32, 0),
           ("q5_1", 640, 32, 1), ("q5_1", 64, 32, 1), ("span64", 576, 32, 1),
           ("span65", 576, 32, 1)]  # one value wider: int16


ALL = 2  # mw_set_int8_tiles: also Q4_0/Q4_1 (1, the default: K-quants and q8 float tables)
# q8 codes that span at most 64 values: the kernel shifts them to unsigned (Q5_0, Q5_1, and the
# widest span that still fits); "q8" is the full -128..127 (Q8_0's sign trick)
CODE_SPANS = {"q5_0": (-16, 15), "q5_1": (0, 31), "span64": (-40, 23), "span65": (-40, 24)}


@pytest.fixture
def isa(isa_library):
    name, cdll = isa_library
    cdll.mw_set_int_acts(1)
    cdll.mw_set_int8_tiles(ALL)
    yield name
    cdll.mw_set_int8_tiles(1)


def _kquant(kind: str, n: int, k: int, group: int, e: int, seed: int, zero_offsets=()):
    """Codes at their extremes (q8: -128 and 127 included), scale and offset tables in format e
    (two-level: sub-scales -128..127), rows listed in zero_offsets with all-zero offsets (Q6_K's
    and Q4_0's case)."""
    g = torch.Generator().manual_seed(seed)
    if e < 2:  # one float a group
        s = torch.rand(n, k // group, generator=g) * 0.1
        c = -torch.rand(n, k // group, generator=g) * 0.1
        c[list(zero_offsets)] = 0
        s, c = (s.half(), c.half()) if e == 1 else (s, c)
    else:
        supers = k // (group * e)
        d_s = torch.rand(n, supers, generator=g) * 0.01
        d_c = -torch.rand(n, supers, generator=g) * 0.01
        d_c[list(zero_offsets)] = 0
        s = two_level_table(d_s, torch.randint(-128, 128, (n, supers * e), generator=g))
        c = two_level_table(d_c, torch.randint(-128, 128, (n, supers * e), generator=g))
    if kind == "q4":
        q = torch.randint(0, 16, (n, k), generator=g)
        q[0, :32] = 15
        packed = q.view(n, k // 32, 2, 16).to(torch.uint8)
        codes = (packed[:, :, 0] | (packed[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    elif kind in CODE_SPANS:  # q8 codes of a narrow span, its ends included
        lo, hi = CODE_SPANS[kind]
        q = torch.randint(lo, hi + 1, (n, k), generator=g)
        q[0, :64], q[-1, :64] = lo, hi
        codes = q.to(torch.int8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g)
        q[0, :64], q[-1, :64] = -128, 127
        codes = q.to(torch.int8)
    return codes, s, c, q


def _reference(x: torch.Tensor, q: torch.Tensor, s, c, group: int) -> torch.Tensor:
    """y in float64 from int8 activations quantized as documented (the integer dot products are
    exact in float64), plus the offsets against the exact float sums."""
    m, k = x.shape
    unit = SUPER if s.dim() == 3 else 32  # two-level tables: a scale a superblock, else a block
    xs = x.view(m, k // unit, unit)
    amax = xs.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = torch.round(xs * inv).double().view(m, k)  # float32 product, half to even: as cvtps
    dx = (amax / 127.0).double().repeat_interleave(unit, dim=2).view(m, k)
    w = q.double().view(q.shape[0], -1, group) * float_table(s).double()[..., None]
    xq = a * dx  # the rounded activations: both the codes and the offsets meet these
    y = xq @ w.view(q.shape[0], k).T
    xsum = xq.view(m, k // group, group).sum(dim=2)
    return y + xsum @ float_table(c).double().T


def _matmul(kind):
    return quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul  # CODE_SPANS: q8 codes


@pytest.mark.parametrize("kind, k, group, e", KQUANTS)
def test_int8_tiles_equal_the_quantized_reference(isa, kind, k, group, e):
    lib = build.lib()
    takes = bool(lib.mw_int8_tiles_fit(int(kind == "q4"), k, group, e))
    assert takes == (lib.mw_int_gemm_isa() >= 2)  # every AVX2 build, no other
    # Q8_0-like q8 codes with float tables (a span over 64 values) go back to int16 in C
    takes = takes and not (kind in ("q8", "span65") and e < 2)
    g = torch.Generator().manual_seed(k)
    for n in (1, 16, 37):  # one row, a whole row chunk, past two chunks
        codes, s, c, q = _kquant(kind, n, k, group, e, seed=n, zero_offsets=(n // 2,))
        for m in TOKENS:
            x = torch.randn(m, k, generator=g)
            x[:, 5] *= 40  # an outlier channel: its superblock's scale is coarse, the others not
            y = _matmul(kind)(x, codes, s, c)
            assert y.shape == (m, n) and torch.isfinite(y).all()
            if takes:
                ref = _reference(x, q, s, c, group)
                size = x.double().abs() @ (q.double().abs().view(n, -1, group)
                                           * float_table(s).double().abs()[..., None]).view(n, k).T
                assert ((y.double() - ref).abs() <= 1e-5 * size + 1e-5).all()
            else:  # int_gemm.c's int16 result
                lib.mw_set_int8_tiles(0)
                assert torch.equal(y, _matmul(kind)(x, codes, s, c))
                lib.mw_set_int8_tiles(ALL)


@pytest.mark.parametrize("kind, k, group, e", KQUANTS[:4] + KQUANTS[13:14])
def test_decode_batches_and_other_tables_stay_off_int8(isa, kind, k, group, e):
    """At most MIN_TOKENS tokens, q8 weights with 16-value groups in float tables, or K off the
    superblock give exactly what int_gemm.c gives with the int8 tiles switched off."""
    lib = build.lib()
    g = torch.Generator().manual_seed(7)
    codes, s, c, q = _kquant(kind, 20, k, group, e, seed=3)
    cases = [(m, s, c) for m in (1, 8, 9, MIN_TOKENS)]
    if kind == "q8" and e == 16:  # Q6_K's groups as float tables (a tensor-parallel cut's widening)
        cases.append((40, float_table(s).half(), float_table(c).half()))
    for m, ss, cc in cases:
        x = torch.randn(m, k, generator=g)
        on = _matmul(kind)(x, codes, ss, cc)
        lib.mw_set_int8_tiles(0)
        off = _matmul(kind)(x, codes, ss, cc)
        lib.mw_set_int8_tiles(ALL)
        assert torch.equal(on, off), (m, ss.dtype)
    if e >= 2:
        assert not lib.mw_int8_tiles_fit(int(kind == "q4"), k + group, group, e)  # K off the superblock
    assert not lib.mw_int8_tiles_fit(1, 160, 32, 1)  # a float-table q4 K off whole pairs of blocks
    assert not lib.mw_int8_tiles_fit(0, 160, 32, 1)  # the same for q8
    assert not lib.mw_int8_tiles_fit(0, 512, 16, 1)  # float tables a half block
    assert not lib.mw_int8_tiles_fit(0, 512, 512, 0)  # per-channel int8 (a float checkpoint's)


def test_the_default_takes_k_quants_and_q8_only(isa):
    """Mode 1 (the default): two-level tables and q8 codes with float tables a block take
    int8 (the shape fits; C then sends Q8_0's wide codes back to int16), Q4_0/Q4_1 float tables
    stay int16."""
    lib = build.lib()
    avx2 = lib.mw_int_gemm_isa() >= 2
    lib.mw_set_int8_tiles(1)
    assert bool(lib.mw_int8_tiles_fit(1, 512, 32, 8)) == avx2
    assert bool(lib.mw_int8_tiles_fit(0, 512, 16, 16)) == avx2
    assert bool(lib.mw_int8_tiles_fit(0, 640, 32, 1)) == avx2
    assert bool(lib.mw_int8_tiles_fit(0, 640, 32, 0)) == avx2
    assert not lib.mw_int8_tiles_fit(1, 512, 32, 1) and not lib.mw_int8_tiles_fit(1, 512, 32, 0)
    lib.mw_set_int8_tiles(ALL)
    assert bool(lib.mw_int8_tiles_fit(1, 512, 32, 1)) == avx2


def test_int8_tiles_follow_the_exact_switch(isa):
    """Integer activations off (the quality reference) turns the int8 tiles off too."""
    lib = build.lib()
    codes, s, c, q = _kquant("q4", 8, 512, 32, 8, seed=5)
    lib.mw_set_int_acts(0)
    try:
        assert not lib.mw_int8_tiles_fit(1, 512, 32, 8)
        x = torch.randn(40, 512)
        y = quant_ops.q4_matmul(x, codes, s, c)
        w = quant_ops.q4_dequantize(codes, s, c, 512)
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    finally:
        lib.mw_set_int_acts(1)


def test_int8_tiles_take_any_prefill_size_in_python():
    """quant_ops sends K-quant weights to the kernels past INT_ACTS_MAX_TOKENS (no dequantized
    BLAS copy), and the result still matches the reference."""
    lib = build.lib()
    if not lib.mw_int8_tiles_fit(1, 512, 32, 8):
        pytest.skip("this build has no int8 tiles (not AVX2)")
    codes, s, c, q = _kquant("q4", 24, 512, 32, 8, seed=9)
    m = quant_ops.INT_ACTS_MAX_TOKENS + 45
    x = torch.randn(m, 512)
    y = quant_ops.q4_matmul(x, codes, s, c)
    ref = _reference(x, q, s, c, 32)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
