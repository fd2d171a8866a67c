"""int8_dot.c's row kernels (mw_q4_gemm_i8 / mw_q8_gemm_i8): 1..MW_I8_MAX_ROWS tokens at once,
each row bit-identical to the one-token gemv on that token alone. Speculative verification and
small decode batches rely on it: a sequence's logits do not depend on what else is in the step,
so a verified draft reproduces plain decoding token for token."""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import build, quant_ops
from memwall.quant.base import QuantLinear
from memwall.quant.int4_cpu import NativeQ4
from memwall.quant.int8_cpu import NativeQ8

pytestmark = pytest.mark.skipif(not quant_ops.int8_dot_available(),
                                reason="needs the AVX512-VNNI int8 kernels (this CPU or build lacks them)")

MAX_ROWS = 8  # MW_I8_MAX_ROWS in kernels.h


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _q4(n: int, k: int, seed: int, half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layer = QuantLinear(NativeQ4().create_weights(torch.randn(n, k, generator=g)))
    dtype = torch.float16 if half else torch.float32
    return layer.codes, layer.s.to(dtype).contiguous(), layer.c.to(dtype).contiguous()


def _q8(n: int, k: int, group: int, seed: int, half: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g)
    dtype = torch.float16 if half else torch.float32
    s = (torch.rand(n, k // group, generator=g) + 0.1).to(dtype)
    c = (torch.randn(n, k // group, generator=g) * 0.1).to(dtype)
    layer = QuantLinear(NativeQ8().from_codes(q, s.float(), c.float(), "test"))
    return layer.codes, layer.s.to(dtype).contiguous(), layer.c.to(dtype).contiguous()


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[0, :32] *= 100.0  # one block with a large range next to small ones
    return x.contiguous()


def _rows_q4(x, codes, s, c, n):
    lib = build.require()
    y = torch.full((x.shape[0], n), float("nan"))
    ok = lib.mw_q4_gemm_i8(_ptr(x), x.shape[0], x.shape[1], _ptr(codes), _ptr(s), _ptr(c), _ptr(y), n,
                           int(s.dtype == torch.float16))
    return ok, y


def _gemv_q4(x, codes, s, c, n):
    lib = build.require()
    y = torch.full((x.shape[0], n), float("nan"))
    for m in range(x.shape[0]):
        row = x[m].contiguous()
        assert lib.mw_q4_gemv_i8(_ptr(row), x.shape[1], _ptr(codes), _ptr(s), _ptr(c),
                                 _ptr(y) + 4 * m * n, n, int(s.dtype == torch.float16))
    return y


def _rows_q8(x, group, codes, s, c, n):
    lib = build.require()
    y = torch.full((x.shape[0], n), float("nan"))
    ok = lib.mw_q8_gemm_i8(_ptr(x), x.shape[0], x.shape[1], group, _ptr(codes), _ptr(s), _ptr(c),
                           _ptr(y), n, int(s.dtype == torch.float16))
    return ok, y


def _gemv_q8(x, group, codes, s, c, n):
    lib = build.require()
    y = torch.full((x.shape[0], n), float("nan"))
    for m in range(x.shape[0]):
        row = x[m].contiguous()
        assert lib.mw_q8_gemv_i8(_ptr(row), x.shape[1], group, _ptr(codes), _ptr(s), _ptr(c),
                                 _ptr(y) + 4 * m * n, n, int(s.dtype == torch.float16))
    return y


@pytest.fixture(autouse=True)
def _int_acts_on():
    quant_ops.set_int_acts(True)
    yield
    quant_ops.set_int_acts(True)


# K: one 64-weight tail only, whole 128-chunks, chunks + tail, SmolLM2's 576 (4.5 chunks)
# and 1536; N: fewer rows than a run, odd counts, several runs with a remainder
@pytest.mark.parametrize("k, n", [(64, 3), (128, 1), (192, 17), (576, 40), (1536, 37)])
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("half", [False, True])
def test_q4_rows_equal_the_gemv_bit_for_bit(k, n, m, half):
    codes, s, c = _q4(n, k, seed=k + n, half=half)
    x = _activations(m, k, seed=m)
    ok, y = _rows_q4(x, codes, s, c, n)
    assert ok
    assert torch.equal(y, _gemv_q4(x, codes, s, c, n))
    quant_ops.set_int_acts(False)
    exact = quant_ops.q4_matmul(x, codes, s, c)
    rel = float((y - exact).norm() / exact.norm())
    assert 0 < rel < 1e-4  # the integer path ran, to the gemv's precision


@pytest.mark.parametrize("group", [16, 32, 64, 256])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("half", [False, True])
def test_q8_rows_equal_the_gemv_bit_for_bit(group, m, half):
    k, n = 512, 21
    codes, s, c = _q8(n, k, group, seed=group, half=half)
    x = _activations(m, k, seed=m + group)
    ok, y = _rows_q8(x, group, codes, s, c, n)
    assert ok
    assert torch.equal(y, _gemv_q8(x, group, codes, s, c, n))


def test_past_the_row_limit_and_unsupported_shapes_decline():
    """The caller runs another kernel where these return 0; nothing is written."""
    codes, s, c = _q4(8, 128, seed=1, half=False)
    ok, y = _rows_q4(_activations(MAX_ROWS + 1, 128, seed=1), codes, s, c, 8)
    assert not ok and torch.isnan(y).all()
    codes, s, c = _q4(8, 96, seed=1, half=False)  # K % 64 != 0
    ok, y = _rows_q4(_activations(2, 96, seed=1), codes, s, c, 8)
    assert not ok and torch.isnan(y).all()
    quant_ops.set_int_acts(False)  # the exact kernels were asked for
    codes, s, c = _q4(8, 128, seed=1, half=False)
    ok, _ = _rows_q4(_activations(2, 128, seed=1), codes, s, c, 8)
    assert not ok


@pytest.mark.parametrize("m", [2, 4, 8])
def test_a_batch_gives_each_token_what_it_gets_alone(m):
    """quant_ops' matmul (the path every model layer and the fused decode step take) is
    batch-invariant up to MAX_ROWS tokens: row i of a batch == token i by itself."""
    codes, s, c = _q4(96, 576, seed=5, half=True)
    x = _activations(m, 576, seed=7)
    batch = quant_ops.q4_matmul(x, codes, s, c)
    alone = torch.cat([quant_ops.q4_matmul(x[i:i + 1].contiguous(), codes, s, c) for i in range(m)])
    assert torch.equal(batch, alone)
    codes8, s8, c8 = _q8(96, 576, 32, seed=5, half=True)
    batch = quant_ops.q8_matmul(x, codes8, s8, c8)
    alone = torch.cat([quant_ops.q8_matmul(x[i:i + 1].contiguous(), codes8, s8, c8) for i in range(m)])
    assert torch.equal(batch, alone)


def test_nan_and_zero_blocks_match_the_gemv():
    codes, s, c = _q4(16, 256, seed=3, half=False)
    x = _activations(3, 256, seed=3)
    x[1, 32:64] = 0.0  # a block of zeros: scale 0
    x[2, 5] = float("nan")
    ok, y = _rows_q4(x, codes, s, c, 16)
    assert ok
    ref = _gemv_q4(x, codes, s, c, 16)
    assert torch.equal(y[:2], ref[:2])
    assert torch.isnan(y[2]).all() == torch.isnan(ref[2]).all()

