"""panel_gemm.c: batched q4/q8 matmuls on AVX-512 VNNI with 16 output rows across the lanes and
int16 activations (a scale per 32 values).

Checked against the float64 product of the dequantized weight: token counts across the
8-token tiles (9, 15, 16, 17, 33, 100) and past the 2,048-token step budget, row counts across
the 16-row panels (1, 15, 16, 17, 33), K from one block to SmolLM2's 1,536, every table format
(fp32, fp16, two-level), tables of offsets and none, q8 groups of 16, 32, 64 and a whole row.
The entry points say "no" (0) where they cannot: builds without VNNI, integer activations off,
K not a multiple of 32. And q4_matmul / q8_matmul take this path for prefill-sized batches.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from memwall.kernels.cpu import build, quant_ops
from memwall.kernels.cpu.layout import two_level_table

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")

INT16_REL = 2e-4  # int16 activations: ~2e-5 relative error on random data; a margin of 10x


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _q4(n: int, k: int, fmt: int, offsets: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    if fmt == 8:  # two-level: Q4_K's 8 sub-scales a 256-value superblock
        s = two_level_table(torch.rand(n, k // 256, generator=g) * 0.01,
                            torch.randint(-128, 128, (n, k // 32), generator=g))
        c = two_level_table(torch.rand(n, k // 256, generator=g) * -0.01,
                            torch.randint(0, 128, (n, k // 32), generator=g)) if offsets else None
    else:
        s = torch.rand(n, k // 32, generator=g) * 0.01
        c = -torch.rand(n, k // 32, generator=g) * 0.08 if offsets else None
        if fmt == 1:
            s, c = s.half(), None if c is None else c.half()
    return codes, s, c


def _q8(n: int, k: int, group: int, fmt: int, offsets: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    s = torch.rand(n, k // group, generator=g) * 0.01
    c = torch.randn(n, k // group, generator=g) * 0.01 if offsets else None
    if fmt == 1:
        s, c = s.half(), None if c is None else c.half()
    return codes, s, c


def _reference(kind: str, x: torch.Tensor, codes, s, c, k: int) -> torch.Tensor:
    w = (quant_ops.q4_dequantize(codes, s, c, k) if kind == "q4"
         else quant_ops.q8_dequantize(codes, s, c))
    return (x.double() @ w.double().T).float()


def _call(cdll, kind: str, x: torch.Tensor, codes, s, c, n: int, group: int) -> tuple[int, torch.Tensor]:
    m, k = x.shape
    y = torch.full((m, n), float("nan"))
    fmt = quant_ops.scale_format(s)
    if kind == "q4":
        ok = cdll.mw_q4_gemm_p16(x.data_ptr(), m, k, codes.data_ptr(), s.data_ptr(), _ptr(c),
                                 y.data_ptr(), n, fmt)
    else:
        ok = cdll.mw_q8_gemm_p16(x.data_ptr(), m, k, group, codes.data_ptr(), s.data_ptr(),
                                 _ptr(c), y.data_ptr(), n, fmt)
    return ok, y


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(y).all()
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < INT16_REL, err
    # every element near its own reference, not just the norm (a wrong lane or tail shows here)
    scale = ref.abs().max().item()
    assert (y - ref).abs().max().item() < 1e-3 * scale


def test_builds_without_vnni_say_no(isa_library) -> None:
    """Each instruction-set build: the panels where it has AVX-512 VNNI, else 0 (the caller's
    next path), never a wrong result."""
    isa, cdll = isa_library
    x, (codes, s, c) = torch.randn(20, 64), _q4(16, 64, 1, True, 0)
    ok, y = _call(cdll, "q4", x, codes, s, c, 16, 32)
    assert ok == cdll.mw_panel_available()
    if ok:
        _close(y, _reference("q4", x, codes, s, c, 64))
    else:
        assert isa != "native" or "avx512_vnni" not in build.cpu_flags()


@pytest.fixture
def vnni():
    cdll = build.require()
    if not cdll.mw_panel_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the panel kernels are not built")
    return cdll


@pytest.mark.parametrize("m", [9, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("fmt", [0, 1], ids=["f32", "f16"])
@pytest.mark.parametrize("offsets", [True, False], ids=["c", "noc"])
def test_q4_panels_equal_the_float_product(vnni, m, n, fmt, offsets) -> None:
    k = 96  # three blocks
    codes, s, c = _q4(n, k, fmt, offsets, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ok, y = _call(vnni, "q4", x, codes, s, c, n, 32)
    assert ok == 1
    _close(y, _reference("q4", x, codes, s, c, k))


@pytest.mark.parametrize("k", [32, 576, 1536])
def test_q4_panels_on_model_widths(vnni, k) -> None:
    codes, s, c = _q4(40, k, 1, True, seed=k)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(k)) * 3
    x[:, 7] = 80.0  # an outlier feature, as real hidden states have: only its block's scale moves
    ok, y = _call(vnni, "q4", x, codes, s, c, 40, 32)
    assert ok == 1
    _close(y, _reference("q4", x, codes, s, c, k))


@pytest.mark.parametrize("offsets", [True, False], ids=["c", "noc"])
def test_q4_panels_with_two_level_tables(vnni, offsets) -> None:
    codes, s, c = _q4(33, 512, 8, offsets, seed=5)
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(5))
    ok, y = _call(vnni, "q4", x, codes, s, c, 33, 32)
    assert ok == 1
    _close(y, _reference("q4", x, codes, s, c, 512))


@pytest.mark.parametrize("group", [16, 32, 64, 640])
@pytest.mark.parametrize("fmt", [0, 1], ids=["f32", "f16"])
@pytest.mark.parametrize("offsets", [True, False], ids=["c", "noc"])
def test_q8_panels_equal_the_float_product(vnni, group, fmt, offsets) -> None:
    k, n, m = 640, 37, 21
    codes, s, c = _q8(n, k, group, fmt, offsets, seed=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(group))
    ok, y = _call(vnni, "q8", x, codes, s, c, n, group)
    assert ok == 1
    _close(y, _reference("q8", x, codes, s, c, k))


def test_q8_panels_with_two_level_sixteen_value_groups(vnni) -> None:
    g = torch.Generator().manual_seed(3)
    n, k = 18, 512
    codes = torch.randint(-32, 32, (n, k), generator=g).to(torch.int8)  # Q6_K's codes
    s = two_level_table(torch.rand(n, k // 256, generator=g) * 0.01,
                        torch.randint(-128, 128, (n, k // 16), generator=g))
    x = torch.randn(11, k, generator=g)
    ok, y = _call(vnni, "q8", x, codes, s, None, n, 16)
    assert ok == 1
    _close(y, _reference("q8", x, codes, s, None, k))


def test_panels_refuse_what_they_cannot_take(vnni) -> None:
    x = torch.randn(12, 64)
    codes, s, c = _q4(16, 64, 1, True, 0)
    quant_ops.set_int_acts(False)
    try:
        assert _call(vnni, "q4", x, codes, s, c, 16, 32)[0] == 0  # the exact kernels' turn
    finally:
        quant_ops.set_int_acts(True)
    codes8, s8, c8 = _q8(16, 48, 16, 0, True, 0)  # q8 groups of 16, K = 48: no 32-value blocks
    assert _call(vnni, "q8", torch.randn(12, 48), codes8, s8, c8, 16, 16)[0] == 0
    # no tokens or no rows: nothing to do, nothing written
    y = torch.full((0, 16), 1.0)
    assert vnni.mw_q4_gemm_p16(ctypes.c_void_p(0), 0, 64, codes.data_ptr(), s.data_ptr(),
                               c.data_ptr(), y.data_ptr(), 16, 1) == 0


def test_matmul_takes_the_panels_past_a_step_budget(vnni) -> None:
    """q4_matmul on 2,049 tokens (past the default 2,048-token budget, not a multiple of 8 or
    16) and 300 rows: the int16 accuracy of the panels, not the exact tiles' bits."""
    k, n, m = 576, 300, 2049
    codes, s, c = _q4(n, k, 1, True, seed=9)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    y = quant_ops.q4_matmul(x, codes, s, c)
    ref = _reference("q4", x, codes, s, c, k)
    _close(y, ref)
    quant_ops.set_int_acts(False)
    try:
        exact = quant_ops.q4_matmul(x, codes, s, c)
    finally:
        quant_ops.set_int_acts(True)
    assert not torch.equal(y, exact)  # the integer path ran, not the exact one
    ok, direct = _call(vnni, "q4", x, codes, s, c, n, 32)
    assert ok == 1 and torch.equal(y, direct)
