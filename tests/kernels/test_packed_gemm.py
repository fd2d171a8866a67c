"""packed_gemm.c and panels.py: q4/q8 weights packed into 16-row panels in place.

What must hold: packing is a permutation (unpack gives the bytes back); 1..16 tokens give each
row bit for bit what that token gets alone (decode batches and speculative verification
reproduce one-token decoding); every size is within the integer activations' error of the
float weight (more than 16 tokens take the int16 panels); the exact mode is fp32-accurate;
the row reader (a tied embedding) equals the dequantized rows exactly; builds without AVX-512
VNNI have no packed kernels and refuse instead of computing garbage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memwall.kernels.cpu import build, panels, quant_ops
from memwall.kernels.cpu.layout import LayoutError, PackedWeight, two_level_table

pytestmark = pytest.mark.skipif(not panels.available(),
                                reason="needs the AVX-512 VNNI kernels (this CPU or build lacks them)")

# half: float16 tables (True), float32 (False), two-level with 8 sub-values a superblock ("K":
# Q4_K, Q5_K) or q8 in 16-value groups with 16 ("K16": Q6_K, no offsets)
FORMATS = [(kind, half, off) for kind in ("q4", "q8") for half in (False, True, "K")
           for off in (False, True)] + [("q8", "K16", False)]
SHAPES = [(16, 32), (48, 96), (192, 576), (64, 1536)]


def _weight(kind: str, n: int, k: int, half, off: bool, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    group = 32
    if half in ("K", "K16"):  # K-quants' tables: a float32 d a superblock, int8 sub-values
        k = max(256, k // 256 * 256)
        supers, subs = k // 256, 8 if half == "K" else 16
        group = 256 // subs

        def table(lo: int) -> torch.Tensor:
            d = torch.rand(n, supers, generator=g) * 0.002 + 1e-4
            return two_level_table(d, torch.randint(lo, 64, (n, subs * supers), generator=g))

        s, c = table(-63 if half == "K16" else 1), table(-63) if off else None
    else:
        dtype = torch.float16 if half else torch.float32
        s = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).to(dtype)
        c = (torch.randn(n, k // 32, generator=g) * 0.05).to(dtype) if off else None
    if kind == "q4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return PackedWeight(kind, group, n, k, codes, s, c)


def _dense(w: PackedWeight) -> torch.Tensor:
    if w.kind == "q4":
        return quant_ops.q4_dequantize(w.codes, w.scales, w.offsets, w.k)
    return quant_ops.q8_dequantize(w.codes, w.scales, w.offsets)


def _packed_copy(w: PackedWeight) -> PackedWeight:
    return panels.pack_(dataclasses.replace(
        w, codes=w.codes.clone(), scales=w.scales.clone(),
        offsets=None if w.offsets is None else w.offsets.clone()))


def _activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (torch.rand(m, 1, generator=g) * 4 + 0.1)
    x[0, :32] *= 100.0  # one block with a large range beside small ones
    if m > 2:
        x[2, 32:64] = 0.0  # an all-zero block (scale 0)
    return x.contiguous()


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind,half,off", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_is_a_permutation(kind, half, off, n, k):
    w = _weight(kind, n, k, half, off)
    before = [t.clone() for t in (w.codes, w.scales, w.offsets) if t is not None]
    packed = panels.pack_(dataclasses.replace(w))
    assert packed.kind == "panels" and packed.codes is w.codes  # in place: no second copy
    if n > 16 or w.k > 32:
        assert not torch.equal(packed.codes, before[0])
    back = panels.unpack_(packed)
    assert back.kind == kind
    for t, b in zip((back.codes, back.scales, back.offsets), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("kind,half,off", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_alone_and_in_batches_agree_bit_for_bit(kind, half, off, n, k):
    w = _weight(kind, n, k, half, off)
    packed = _packed_copy(w)
    k = w.k
    x = _activations(16, k)
    ref = x.double() @ _dense(w).double().T
    alone = torch.cat([panels.matmul(x[i:i + 1].contiguous(), packed) for i in range(16)])
    assert _rel_err(alone, ref) < 1e-4  # two int8 digits a value: ~2e-5
    for m in (2, 3, 7, 8, 9, 15, 16):
        assert torch.equal(panels.matmul(x[:m].contiguous(), packed), alone[:m]), m


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("kind,half,off", [("q4", True, True), ("q8", True, False)])
def test_one_token_splits_panels_evenly_with_the_same_bits(kind, half, off, threads):
    """One token: each thread an equal run of panels in passes of 4, 2 and 1 (37 and 9 panels
    split unevenly over every thread count here); each output the bits of the batched path."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # torch's OpenMP pool is the one the kernels run on
    try:
        for n in (16 * 37, 16 * 9, 16 * 2):
            w = _weight(kind, n, 96, half, off, seed=n)
            packed = _packed_copy(w)
            x = _activations(2, w.k)
            batched = panels.matmul(x, packed)
            alone = panels.matmul(x[:1].contiguous(), packed)
            assert torch.equal(alone, batched[:1]), n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind,half,off", FORMATS)
@pytest.mark.parametrize("m", [17, 40, 130])
def test_many_tokens_take_the_int16_panels(kind, half, off, m):
    w = _weight(kind, 64, 576, half, off)
    packed = _packed_copy(w)
    x = _activations(m, w.k)
    y = panels.matmul(x, packed)
    assert _rel_err(y, x.double() @ _dense(w).double().T) < 1e-4


@pytest.mark.parametrize("kind,half,off", FORMATS)
def test_exact_mode_is_fp32(kind, half, off):
    w = _weight(kind, 48, 576, half, off)
    packed = _packed_copy(w)
    x = _activations(20, w.k)
    ref = x.double() @ _dense(w).double().T
    quant_ops.set_int_acts(False)
    try:
        for m in (1, 5, 20):
            assert _rel_err(panels.matmul(x[:m].contiguous(), packed), ref[:m]) < 1e-6
    finally:
        quant_ops.set_int_acts(True)


@pytest.mark.parametrize("kind,half,off", FORMATS)
def test_row_reader_equals_the_dequantized_rows(kind, half, off):
    w = _weight(kind, 64, 96, half, off)
    packed = _packed_copy(w)
    ids = torch.tensor([[0, 63], [17, 5], [16, 15]])
    assert torch.equal(panels.rows(packed, ids), _dense(w)[ids])
    with pytest.raises(IndexError):
        panels.rows(packed, torch.tensor([64]))


def test_extreme_codes_and_empty_batches():
    """Codes at both ends of their range (q8 -128 and 127 read + 128 as 0 and 255) against
    activations at the digits' limits: the integer sums must not wrap."""
    n, k = 32, 4096
    for kind, lo, hi in (("q4", 0, 15), ("q8", -128, 127)):
        w = _weight(kind, n, k, True, kind == "q4")
        codes = torch.full_like(w.codes, hi if kind == "q8" else 0xFF)
        codes[::2] = lo if kind == "q8" else 0x00
        w = dataclasses.replace(w, codes=codes)
        packed = _packed_copy(w)
        x = torch.full((3, k), 7.5)
        x[1] = -7.5
        x[2, ::2] = 1e-3
        y = panels.matmul(x, packed)
        assert _rel_err(y, x.double() @ _dense(w).double().T) < 1e-4
        assert panels.matmul(torch.empty(0, k), packed).shape == (0, n)


def test_layouts_that_do_not_fit_are_refused():
    assert not panels.fits(_weight("q4", 40, 64, True, True))  # 40 rows: not whole panels
    q8_16 = PackedWeight("q8", 16, 32, 64, torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 4))
    assert not panels.fits(q8_16)  # a 16-value group
    with pytest.raises(LayoutError):
        panels.pack_(q8_16)
    with pytest.raises(LayoutError):
        panels.matmul(torch.zeros(1, 64), _weight("q4", 32, 64, True, True))  # not packed


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_builds_without_vnni_have_no_packed_kernels(isa):
    if not build.runs_here(isa):
        pytest.skip(f"this CPU cannot run the {isa} build")
    lib = build.library(isa)
    assert lib.mw_packed_available() == 0
    packed = _packed_copy(_weight("q4", 16, 32, True, True))
    x, y = torch.ones(1, 32), torch.zeros(1, 16)
    assert lib.mw_packed_gemm(x.data_ptr(), 1, 32, packed.codes.data_ptr(), packed.scales.data_ptr(),
                              packed.offsets.data_ptr(), packed.flags, y.data_ptr(), 16, 16) == 0
