"""The CPU kernels behind QuantLinear against plain float math.

Tolerances: the native kernels compute in fp32 from weights bit-identical to the reference,
so only summation order differs (relative error ~1e-7; we allow 1e-5). torch's int4/int8
ops take bf16 activations and round their output to bf16, so they get 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memwall.kernels.cpu import quant_ops
from memwall.quant.base import QuantLinear
from memwall.quant.int4_cpu import (DEQUANT_MIN_TOKENS, Int4WeightOnly, NativeQ4, _layout,
                                    _unpack_rows, dequantize_int4, pack_planes, quantize_int4)
from memwall.quant.int8_cpu import Int8WeightOnly, NativeQ8, quantize_int8

needs_native = pytest.mark.skipif(not quant_ops.available(), reason="no C compiler for the native kernels")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --------------------------------------------------------------------------- torch's int4 op

def test_tinygemm_formula_is_q_minus_8_times_scale_plus_zero():
    """The op's dequantization, checked by experiment: w = (q - 8) * scale + zero."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (1, 32, 64), generator=gen)
    scale = torch.rand(1, 32, 2, generator=gen) + 0.1
    zero = torch.randn(1, 32, 2, generator=gen)
    layer = QuantLinear(Int4WeightOnly(32).from_planes(q, scale, zero, "test"))
    w = (q[0].float() - 8).view(32, 2, 32) * scale[0, :, :, None].bfloat16().float() \
        + zero[0, :, :, None].bfloat16().float()
    x = torch.randn(3, 64, generator=gen)
    assert rel_err(layer(x), F.linear(x, w.view(32, 64))) < 1e-2


def test_unpack_layout_round_trips():
    layout = _layout()
    if layout is None:
        pytest.skip("torch's int4 packing on this CPU is not one we can read back")
    q = torch.randint(0, 16, (64 * 3 + 16, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(_unpack_rows(packed, 96, *layout).int(), q)


@pytest.mark.parametrize("rows", [24, 64, 100])
@pytest.mark.parametrize("tokens", [1, 5, DEQUANT_MIN_TOKENS + 3])
def test_int4_quantized_linear_matches_its_dequantized_weight(rows, tokens):
    """Rows not a multiple of 16 are padded and sliced; both the GEMV and prefill paths."""
    torch.manual_seed(rows)
    w = torch.randn(rows, 128)
    layer = QuantLinear(Int4WeightOnly(64).create_weights(w), bias=torch.randn(rows))
    x = torch.randn(tokens, 128)
    ref = F.linear(x, dequantize_int4(layer)[:rows], layer.bias)
    y = layer(x)
    assert y.shape == (tokens, rows) and y.dtype == torch.float32
    assert rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("group", [32, 128])
def test_int4_quantization_error_is_at_most_half_a_step(group):
    torch.manual_seed(1)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3
    q, scale, zero = quantize_int4(w, group)
    deq = ((q.float() - 8).view(48, -1, group) * scale[..., None] + zero[..., None]).view(48, 256)
    bound = (scale / 2).repeat_interleave(group, dim=1) * (1 + 1e-5)
    assert ((deq - w).abs() <= bound + 1e-7).all()
    assert rel_err(deq, w) < (0.1 if group == 32 else 0.14)  # 4 bits of a Gaussian


def test_int4_planes_concat_like_the_joined_codes():
    torch.manual_seed(2)
    parts = [Int4WeightOnly(32).create_weights(torch.randn(n, 64)) for n in (64, 24, 64)]
    joined = Int4WeightOnly(32).concat(parts)
    if _layout() is None:
        assert joined is None
        return
    x = torch.randn(2, 64)
    ref = torch.cat([QuantLinear(p)(x) for p in parts], dim=1)
    assert torch.allclose(QuantLinear(joined)(x), ref, rtol=1e-2, atol=1e-2)


def test_int4_rejects_bad_group():
    with pytest.raises(ValueError, match="group_size 48"):
        Int4WeightOnly(48)
    with pytest.raises(ValueError, match="divide in_features"):
        pack_planes(torch.zeros(1, 16, 48), torch.ones(1, 16, 1), torch.zeros(1, 16, 1), 32)


# --------------------------------------------------------------------------- int8

def test_int8_quantization_error_is_at_most_half_a_step():
    torch.manual_seed(3)
    w = torch.randn(40, 96) * torch.rand(40, 1)
    q, scale = quantize_int8(w)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert scale.bfloat16().float().equal(scale)  # what the bf16 op reads is what we used


@pytest.mark.parametrize("tokens", [1, DEQUANT_MIN_TOKENS])
def test_int8_torch_op_matches_its_weight(tokens):
    torch.manual_seed(4)
    w = torch.randn(40, 96)
    layer = QuantLinear(Int8WeightOnly().create_weights(w))
    q, scale = quantize_int8(w)
    x = torch.randn(tokens, 96)
    assert rel_err(layer(x), F.linear(x, q.float() * scale[:, None])) < 1e-2
    assert rel_err(layer(x), F.linear(x, w)) < 2e-2  # and the quantization itself is mild


def test_int8_refuses_inputs_torch_would_crash_on():
    assert not Int8WeightOnly().supports(8, 100)  # the op segfaults when K % 16 != 0
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8WeightOnly().create_weights(torch.randn(8, 100))


# --------------------------------------------------------------------------- native kernels

@needs_native
@pytest.mark.parametrize("tokens", [1, 3, quant_ops.MAX_TOKENS + 1])
@pytest.mark.parametrize("rows", [64, 30])  # 30: not a multiple of the 4-row fast path
def test_native_q4_matches_float(tokens, rows):
    torch.manual_seed(5)
    q = torch.randint(0, 16, (rows, 96))
    s, c = torch.rand(rows, 3), torch.randn(rows, 3)
    w = (q.float().view(rows, 3, 32) * s[..., None] + c[..., None]).view(rows, 96)
    layer = QuantLinear(NativeQ4().from_codes(q, s, c, "test"))
    x = torch.randn(tokens, 96)
    assert rel_err(layer(x), F.linear(x, w)) < 1e-5
    assert torch.equal(quant_ops.q4_dequantize(layer.codes, layer.s, layer.c, 96), w)


@needs_native
@pytest.mark.parametrize("group", [16, 32, 96])
@pytest.mark.parametrize("tokens", [1, 2, quant_ops.MAX_TOKENS + 1])
def test_native_q8_matches_float(group, tokens):
    torch.manual_seed(6)
    q = torch.randint(-128, 128, (36, 96))
    s, c = torch.rand(36, 96 // group), torch.randn(36, 96 // group)
    w = (q.float().view(36, -1, group) * s[..., None] + c[..., None]).view(36, 96)
    layer = QuantLinear(NativeQ8().from_codes(q, s, c, "test"))
    x = torch.randn(tokens, 96)
    assert rel_err(layer(x), F.linear(x, w)) < 1e-5


@needs_native
def test_native_float_quantizers_and_concat():
    torch.manual_seed(7)
    w = torch.randn(64, 128)
    x = torch.randn(2, 128)
    for method, tol in ((NativeQ8(), 0.02), (NativeQ4(), 0.15)):
        a, b = method.create_weights(w[:40]), method.create_weights(w[40:])
        joined = QuantLinear(method.concat([a, b]))
        assert torch.allclose(joined(x), torch.cat([QuantLinear(a)(x), QuantLinear(b)(x)], 1))
        assert rel_err(joined(x), F.linear(x, w)) < tol
    assert NativeQ4().concat([NativeQ4().create_weights(w), NativeQ8().create_weights(w)]) is None


@needs_native
def test_int8_with_a_scale_every_32_values():
    """NativeQ8(group_size=32) quantizes as GGUF's Q8_0 (a scale a 32-value block, no offset):
    a row whose other blocks are 100x larger keeps its small block's precision, which one
    scale a row loses; bad group sizes and widths are refused."""
    torch.manual_seed(3)
    w = torch.randn(32, 128) * 0.01
    w[:, 64:] *= 100  # blocks 2 and 3 of every row dwarf blocks 0 and 1
    x = torch.randn(3, 128)
    grouped, per_row = NativeQ8(group_size=32).create_weights(w), NativeQ8().create_weights(w)
    assert grouped.source == "int8 g32" and tuple(grouped.tensors["s"].shape) == (32, 4)
    x_small = x.clone()
    x_small[:, 64:] = 0  # only the small blocks count
    errors = [rel_err(QuantLinear(q)(x_small), F.linear(x_small, w)) for q in (grouped, per_row)]
    assert errors[0] < 0.01 < errors[1], errors
    assert rel_err(QuantLinear(grouped)(x), F.linear(x, w)) < 0.01
    odd = NativeQ8(group_size=32).create_weights(torch.randn(16, 48))  # 48 = 32 + 16: per row
    assert odd.source == "int8 per-channel" and tuple(odd.tensors["s"].shape) == (16, 1)
    with pytest.raises(ValueError):
        NativeQ8(group_size=24)


@needs_native
def test_bf16_activations_come_back_bf16():
    layer = QuantLinear(NativeQ8().create_weights(torch.randn(16, 32)))
    assert layer(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


@needs_native
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("tokens", [5, 16, 37])  # one part tile, one whole tile, tiles + a remainder
def test_native_kernels_block_long_inputs(kind, tokens):
    """K = 2048 splits into several L1-sized blocks whose partial sums add into y, for a small
    batch (one parallel pass over rows) and for prefill (16-token tiles, a tile per thread)."""
    torch.manual_seed(8)
    rows, k = 40, 2048
    if kind == "q4":
        q = torch.randint(0, 16, (rows, k))
        method = NativeQ4()
    else:
        q = torch.randint(-128, 128, (rows, k))
        method = NativeQ8()
    s, c = torch.rand(rows, k // 32), torch.randn(rows, k // 32)
    w = (q.float().view(rows, -1, 32) * s[..., None] + c[..., None]).view(rows, k)
    layer = QuantLinear(method.from_codes(q, s, c, "test"))
    x = torch.randn(tokens, k)
    assert rel_err(layer(x), F.linear(x, w)) < 1e-5
    # every token's row is its own: the same as computing it alone
    assert torch.allclose(layer(x)[-1:], layer(x[-1:].contiguous()), rtol=1e-4, atol=1e-3)
