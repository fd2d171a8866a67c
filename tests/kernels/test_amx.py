"""Split-bf16 matmuls (memwall/kernels/cpu/amx.py, split_bf16.c): the split is exact where it
must be, the product is as precise as fp32 kernels need, and the weight comes out of the q4/q8
layouts exactly as the dequantizer rebuilds it. oneDNN's bf16 math mode runs on any CPU (where
the CPU has no bf16 units it computes in fp32), so these run everywhere; only ``enabled()``
depends on AMX."""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import amx, quant_ops

pytestmark = pytest.mark.skipif(not quant_ops.available(), reason="native kernels not built")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_split_hi_is_bf16_rounded_to_nearest_and_lo_is_the_exact_rest():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(5000, generator=g) * 10 ** torch.randint(-30, 30, (5000,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0, 65504.0, 3e38, -3e38, 1e-40, float("inf")])])
    hi, lo = amx.split(x)
    torch.testing.assert_close(hi, x.bfloat16().float(), rtol=0, atol=0)  # torch rounds RNE too
    finite = torch.isfinite(x)
    assert torch.equal((hi + lo)[finite], x[finite])  # a - hi is exact in float
    assert torch.equal(hi.bfloat16().float(), hi)
    # half a bf16 step at most (its subnormals are 2^-133 apart)
    assert (lo[finite].abs() <= hi[finite].abs() * 2.0 ** -8 + 2.0 ** -134).all()


def test_empty_and_one_element():
    hi, lo = amx.split(torch.empty(0))
    assert hi.shape == lo.shape == (0,)
    hi, lo = amx.split(torch.tensor([1.0 + 2.0 ** -10]))
    assert hi.item() == 1.0 and lo.item() == 2.0 ** -10


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_weight_halves_add_up_to_the_dequantized_weight(kind):
    g = torch.Generator().manual_seed(1)
    n, k = 48, 128
    if kind == "q4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        s, c = torch.rand(n, k // 32, generator=g), torch.randn(n, k // 32, generator=g)
        w = quant_ops.q4_dequantize(codes, s, c, k)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        s, c = torch.rand(n, k // 16, generator=g), torch.randn(n, k // 16, generator=g)
        w = quant_ops.q8_dequantize(codes, s, c)
    hi, lo = amx.split_weight(kind, k, codes, s, c)
    assert torch.equal(hi, w.bfloat16().float())
    assert torch.equal(hi + lo, w)


@pytest.mark.parametrize("tokens", [1, 129, 300])
def test_split_product_is_fp32_grade(tokens):
    """Three bf16 products: ~5e-6 against float64, where one bf16 product is ~3e-3."""
    g = torch.Generator().manual_seed(tokens)
    n, k = 96, 576
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.01
    c = -8 * s
    x = torch.randn(tokens, k, generator=g)
    w = quant_ops.q4_dequantize(codes, s, c, k)
    ref = x.double() @ w.double().T
    y = amx.matmul("q4", x, codes, s, c)
    assert y.dtype == torch.float32 and y.shape == (tokens, n)
    assert _rel(y, ref) < 2e-5


def test_bf16_math_mode_is_restored():
    before = torch.backends.mkldnn.matmul.fp32_precision
    x = torch.randn(4, 64)
    amx.split_linear(x, *amx.split(torch.randn(8, 64)))
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_off_switch(monkeypatch):
    amx.enabled.cache_clear()
    monkeypatch.setenv("MEMWALL_AMX", "0")
    try:
        assert not amx.enabled() and not amx.use_for(4096)
    finally:
        amx.enabled.cache_clear()
