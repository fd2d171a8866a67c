"""Backend routing and the fp8 KV cache (memwall/attention/backend.py).

fp8 tolerance: E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element), so
attention over fp8 K/V against float32 K/V differs by a relative-norm error of a few percent
on unit-normal data (measured ~0.03); the tests allow 0.06. The triton backend runs under
Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import os

import pytest
import torch

from memwall.attention import backend, paged_torch
from memwall.attention.metadata import AttentionMetadata

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
SEQ_LENS, BLOCK = [13, 1, 40], 4
TABLES = [[0, 1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


def backends() -> list[str]:
    names = ["torch"]
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
    except ImportError:
        return names
    if CUDA or type(triton.language.standard.max).__name__ == "InterpretedFunction":
        names.append("triton")
    return names


def test_choose_picks_the_native_backend_on_cpu():
    from memwall.attention.backend import _native_available
    assert backend.choose("cpu") == ("cpu" if _native_available() else "torch")
    if CUDA:
        from memwall.attention import triton_backend
        assert backend.choose("cuda") == ("triton" if triton_backend.available() else "torch")


def test_metadata_for_triton_skips_the_torch_decode_batch():
    meta = AttentionMetadata.build([1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4, backend="triton")
    assert meta.backend == "triton" and meta.decode is None
    assert AttentionMetadata.build([1, 1], [5, 9], [[0, 1], [2, 3, 4]], 4).decode is not None


def test_to_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1e6, 0.1, 448.0, float("inf")])
    y = backend.to_fp8(x).float()
    assert y.tolist()[:2] == [448.0, -448.0] and y[3] == 448.0 and y[4] == 448.0
    assert abs(y[2].item() - 0.1) <= 0.1 * 2 ** -4


@pytest.mark.parametrize("name", backends())
def test_fp8_write_stores_the_rounded_values(name):
    meta = AttentionMetadata.build([3], [3], [[2]], BLOCK, device=DEVICE, backend=name)
    k_cache = torch.zeros(4, BLOCK, 2, 16, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 16, device=DEVICE) * 100
    v = torch.randn(3, 2, 16, device=DEVICE)
    backend.write_kv(k_cache, v_cache, k, v, meta)
    assert torch.equal(k_cache[2, :3].float(), backend.to_fp8(k).float())
    assert torch.equal(v_cache[2, :3].float(), backend.to_fp8(v).float())
    assert k_cache[[0, 1, 3]].float().abs().sum() == 0 and k_cache[2, 3].float().abs().sum() == 0


@pytest.mark.parametrize("name", backends())
def test_fp8_cache_attention_is_close_to_float32(name):
    g = torch.Generator().manual_seed(0)
    tokens = sum(SEQ_LENS)
    q = torch.randn(tokens, 4, 16, generator=g).to(DEVICE)
    k = torch.randn(tokens, 2, 16, generator=g).to(DEVICE)
    v = torch.randn(tokens, 2, 16, generator=g).to(DEVICE)
    ref_meta = AttentionMetadata.build(SEQ_LENS, SEQ_LENS, TABLES, BLOCK, device=DEVICE)
    kf = torch.zeros(16, BLOCK, 2, 16, device=DEVICE)
    vf = torch.zeros_like(kf)
    paged_torch.write_kv(kf, vf, k, v, ref_meta.slot_mapping)
    ref = paged_torch.paged_attention(q, kf, vf, ref_meta, 0.25)
    meta = AttentionMetadata.build(SEQ_LENS, SEQ_LENS, TABLES, BLOCK, device=DEVICE, backend=name)
    k8 = torch.zeros(16, BLOCK, 2, 16, dtype=FP8, device=DEVICE)
    v8 = torch.zeros_like(k8)
    backend.write_kv(k8, v8, k, v, meta)
    out = backend.paged_attention(q, k8, v8, meta, 0.25)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.06, rel
    # decode steps on the fp8 cache read the same cache (one more token per sequence)
    dec_meta = AttentionMetadata.build([1, 1, 1], [s + 1 for s in SEQ_LENS], TABLES, BLOCK,
                                       device=DEVICE, backend=name)
    kd, vd = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    backend.write_kv(k8, v8, kd, vd, dec_meta)
    out = backend.paged_attention(torch.randn(3, 4, 16, device=DEVICE), k8, v8, dec_meta, 0.25)
    assert torch.isfinite(out).all()


def test_each_backend_builds_its_own_metadata_and_the_cpu_backend_matches_the_reference():
    import numpy as np

    from memwall.attention.metadata import CpuAttentionMetadata, TorchAttentionMetadata

    torch_b, cpu_b = backend.get_backend("torch"), backend.get_backend("cpu")
    query_lens, seq_lens = np.array([13, 1, 1]), np.array([13, 4, 40])
    tables = torch.tensor([t + [0] * (11 - len(t)) for t in TABLES])
    slots = []
    for q, s, t in zip(query_lens, seq_lens, TABLES):
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    slots = torch.tensor(slots)
    ref_meta = torch_b.build_metadata(query_lens, seq_lens, tables, slots, BLOCK)
    cpu_meta = cpu_b.build_metadata(query_lens, seq_lens, tables, slots, BLOCK)
    assert type(ref_meta) is TorchAttentionMetadata and type(cpu_meta) is CpuAttentionMetadata
    assert ref_meta.decode.mask is not None and cpu_meta.decode.mask is None  # lengths differ
    if not backend._native_available():
        pytest.skip("the cpu backend's native kernels are not built here")
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(16, BLOCK, 2, 16, generator=g), torch.randn(16, BLOCK, 2, 16, generator=g)
    q = torch.randn(15, 4, 16, generator=g)
    ref = torch_b.forward(q, k_cache, v_cache, ref_meta, 0.25)
    got = cpu_b.forward(q, k_cache, v_cache, cpu_meta, 0.25)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # a sliding layer (Gemma): the decode rows past the window attend natively, and so does
    # the prefill chunk in the same step where the build has the prefill kernel (AVX-512);
    # both as the torch backend computes them
    for window in (3, 5, 39, 64):
        ref = torch_b.forward(q, k_cache, v_cache, ref_meta, 0.25, window=window)
        got = cpu_b.forward(q, k_cache, v_cache, cpu_meta, 0.25, window=window)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(ref, torch_b.forward(q, k_cache, v_cache, ref_meta, 0.25)) or window >= 40
