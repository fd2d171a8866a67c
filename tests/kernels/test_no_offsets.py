"""A weight whose offsets are all zero may leave its offset table out (``c=None``, kernels.h
MW_NO_OFFSETS): every path must then give exactly the result it gives with a table of zeros.

Checked on every instruction-set build, for the one-token / decode-batch kernels that skip the
offset term (1..8 tokens), the row tiles past a tile (9..16), the int8 prefill tiles (17+), the
exact fp32 kernels (integer activations off), the dequantizer, and QuantLinear, which passes
None only for an all-zero buffer and notices when the buffer is replaced or written.
"""

from __future__ import annotations

import pytest
import torch

from memwall.kernels.cpu import build, quant_ops
from memwall.kernels.cpu.layout import two_level_table

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built")

TOKENS = [1, 2, 5, 8, 9, 16, 17, 40]  # one token, a decode tile, past it, the int8 tiles
# kind, K, group, table format (0 fp32, 1 fp16, 16 two-level): Q8_0 / Q5_0 on Gemma 3's 640
# and SmolLM2's 576 (a run of 8 blocks plus a tail), fp32 tables, Q6_K's 16-value groups
SHAPES = [("q8", 640, 32, 1), ("q8", 576, 32, 1), ("q8", 96, 32, 0), ("q8", 512, 16, 16),
          ("q8", 2304, 16, 16), ("q4", 640, 32, 1)]
N = 37  # rows: not a multiple of a row group or chunk


def _weight(kind: str, k: int, group: int, fmt: int, narrow: bool):
    g = torch.Generator().manual_seed(k * 31 + fmt)
    if fmt == 16:
        supers = k // (group * 16)
        s = two_level_table(torch.rand(N, supers, generator=g) * 0.01,
                            torch.randint(-128, 128, (N, supers * 16), generator=g))
        zeros = two_level_table(torch.zeros(N, supers), torch.zeros(N, supers * 16, dtype=torch.int64))
    else:
        s = torch.rand(N, k // group, generator=g) * 0.05
        s = s.half() if fmt == 1 else s
        zeros = torch.zeros_like(s)
    if kind == "q4":
        codes = torch.randint(0, 256, (N, k // 2), generator=g, dtype=torch.uint8)
    else:  # Q5_0's -16..15 (the int8 tiles' narrow codes) or Q8_0's full range
        lo, hi = (-16, 15) if narrow else (-128, 127)
        codes = torch.randint(lo, hi + 1, (N, k), generator=g).to(torch.int8)
    return codes, s, zeros


def _matmul(kind):
    return quant_ops.q4_matmul if kind == "q4" else quant_ops.q8_matmul


@pytest.mark.parametrize("narrow", [False, True], ids=["q8_0", "q5_0"])
@pytest.mark.parametrize("int_acts", [1, 0], ids=["int", "exact"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-K{s[1]}-G{s[2]}-f{s[3]}")
def test_no_offset_table_equals_a_table_of_zeros(isa_library, shape, int_acts, narrow) -> None:
    kind, k, group, fmt = shape
    if kind == "q4" and narrow:
        pytest.skip("q4 codes have one range")
    isa, cdll = isa_library
    codes, s, zeros = _weight(kind, k, group, fmt, narrow)
    torch.manual_seed(0)
    cdll.mw_set_int_acts(int_acts)
    try:
        for m in TOKENS:
            x = torch.randn(m, k) * 3
            with_zeros = _matmul(kind)(x, codes, s, zeros)
            without = _matmul(kind)(x, codes, s, None)
            assert torch.equal(without, with_zeros), (isa, m)
            assert with_zeros.abs().sum() > 0  # the scales did take part
    finally:
        cdll.mw_set_int_acts(1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-K{s[1]}-G{s[2]}-f{s[3]}")
def test_dequantize_without_offsets(isa_library, shape) -> None:
    kind, k, group, fmt = shape
    codes, s, zeros = _weight(kind, k, group, fmt, narrow=False)
    if kind == "q4":
        assert torch.equal(quant_ops.q4_dequantize(codes, s, None, k),
                           quant_ops.q4_dequantize(codes, s, zeros, k))
    else:
        assert torch.equal(quant_ops.q8_dequantize(codes, s, None), quant_ops.q8_dequantize(codes, s, zeros))


def test_quant_linear_leaves_out_only_all_zero_offsets() -> None:
    from memwall.quant.int8_cpu import NativeQ8

    codes, s, zeros = _weight("q8", 640, 32, 1, narrow=True)
    layer_weights = NativeQ8().from_codes(codes.float(), s.float(), zeros.float(), "test")
    from memwall.quant.base import QuantLinear

    layer = QuantLinear(layer_weights)
    assert layer.offsets_or_none() is None
    native = layer.native_parts()[0]
    assert native.offsets is None
    x = torch.randn(3, 640)
    before = layer(x)
    layer.c[5, 3] = 0.25  # written in place: the table counts again
    assert layer.offsets_or_none() is layer.c
    after = layer(x)
    assert not torch.equal(before, after)
    layer.c.zero_()
    assert layer.offsets_or_none() is None
    assert torch.equal(layer(x), before)


def test_quant_linear_made_under_inference_mode() -> None:
    """Inference tensors keep no version counter: checked once per buffer, no error."""
    from memwall.quant.base import QuantLinear
    from memwall.quant.int8_cpu import NativeQ8

    codes, s, zeros = _weight("q8", 640, 32, 1, narrow=True)
    with torch.inference_mode():
        layer = QuantLinear(NativeQ8().from_codes(codes.float(), s.float(), zeros.float(), "test"))
        assert layer.offsets_or_none() is None
        nonzero = QuantLinear(NativeQ8().from_codes(codes.float(), s.float(), zeros.float() + 0.5, "t"))
        assert nonzero.offsets_or_none() is nonzero.c
        x = torch.randn(2, 640)
        assert torch.equal(layer(x), quant_ops.q8_matmul(x, layer.codes, layer.s, layer.c))
