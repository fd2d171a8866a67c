"""FP8 (E4M3) weights, per-output-channel scales (memwall/quant/fp8.py).

CPU: the format's error bounds and the dequantizing fallback against a float Linear.
E4M3 has 3 mantissa bits, so rounding costs at most 2^-4 of a normal value's magnitude; values
below 2^-6 x scale are subnormal and keep an absolute error of at most 2^-10 x scale.
GPU (marked gpu): torch._scaled_mm with per-token activation scales against the fallback.
"""

import pytest
import torch
from torch import nn

from memwall.quant.base import QuantLinear
from memwall.quant.fp8 import (FP8, FP8_MAX, Fp8Linear, dequantize_fp8_rows, quantize_fp8_rows,
                               scaled_mm_supported)
from memwall.quant.transform import get_quant_method, quantize_model

CUDA = torch.cuda.is_available()


def test_quantize_rows_error_is_within_half_an_e4m3_step():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scale
    q, scale = quantize_fp8_rows(w)
    assert q.dtype == FP8 and scale.shape == (64,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))  # range used
    err = (dequantize_fp8_rows(q, scale) - w).abs()
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10)
    assert (err <= bound * 1.0001).all()


def test_zero_rows_stay_zero_and_finite():
    w = torch.zeros(16, 32)
    w[3] = torch.linspace(-1, 1, 32)
    q, scale = quantize_fp8_rows(w)
    back = dequantize_fp8_rows(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(32))


def test_fallback_linear_matches_float_linear():
    torch.manual_seed(1)
    linear = nn.Linear(128, 48, bias=True)
    x = torch.randn(5, 128)
    layer = QuantLinear(Fp8Linear().create_weights(linear.weight.detach()), linear.bias)
    y = layer(x)
    ref = linear(x)
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.04, rel  # measured ~0.02: the per-element 2^-4 bound, averaged over 128 inputs
    # the fallback computes exactly x @ dequantized(w).T + b
    exact = x @ dequantize_fp8_rows(layer.qweight, layer.wscale).T + linear.bias
    torch.testing.assert_close(y, exact, atol=1e-5, rtol=1e-5)


def test_shapes_that_scaled_mm_cannot_take_stay_float():
    method = Fp8Linear()
    assert method.supports(32, 64) and not method.supports(30, 64) and not method.supports(32, 20)
    with pytest.raises(ValueError, match="multiples of 16"):
        method.create_weights(torch.randn(30, 64))


def test_quantize_model_keeps_the_head_and_concat_joins_rows():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    model.lm_head = nn.Linear(16, 48)
    report = quantize_model(model, get_quant_method("fp8"), include_lm_head=False)
    assert set(report.quantized) == {"0", "1"} and report.kept_float == ["lm_head"]
    assert report.quant_bytes < report.float_bytes / 3  # 1 byte + a scale per row vs 4 bytes
    parts = [Fp8Linear().create_weights(torch.randn(16, 32)) for _ in range(3)]
    joined = Fp8Linear().concat(parts)
    assert joined.out_features == 48
    assert torch.equal(joined.tensors["wscale"][16:32], parts[1].tensors["wscale"])


def test_scaled_mm_is_not_used_on_cpu():
    assert not scaled_mm_supported(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_scaled_mm_matches_the_dequantized_matmul_on_gpu():
    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("torch._scaled_mm needs compute capability >= 8.9")
    torch.manual_seed(3)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear(Fp8Linear().create_weights(w)).cuda()
    for tokens in (1, 7, 64):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (tokens, 256)
        deq = x.float() @ dequantize_fp8_rows(layer.qweight, layer.wscale).T
        # activations are quantized too (per token): another 2^-4 per element, averaged
        rel = ((y.float() - deq).norm() / deq.norm()).item()
        assert rel < 0.04, (tokens, rel)
        exact = x.float() @ w.float().T
        assert ((y.float() - exact).norm() / exact.norm()).item() < 0.06
