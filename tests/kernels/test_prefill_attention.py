"""paged_attention.c's prefill kernel: one sequence's chunk attends causally over its paged KV
blocks where they lie (AVX-512 builds, head_dim a multiple of 16).

Against the torch reference (memwall/attention/paged_torch.py): whole prompts and chunks that
follow cached context, across the 32-position work items and the 16-key chunks (1, 15, 16,
17, 31, 32, 33, 100 queries), GQA groups of 1, 3 and 4, head dims 16, 64, 80 and 256, block
sizes 16, 5 and 1 with the blocks scattered, sliding windows (1, 5, 16, 17, 100), and every
KV format the native kernels read. Errors: bad lengths and block ids raise ValueError before C
runs; a head dim the build has no kernel for, NotImplementedError.
"""

from __future__ import annotations

import pytest
import torch

from memwall.attention import kv_quant, paged_torch
from memwall.attention.metadata import AttentionMetadata
from memwall.kernels.cpu import build
from memwall.kernels.cpu.decode import paged_prefill_attention, prefill_attention_available

pytestmark = [
    pytest.mark.skipif(not build.available(), reason="no C compiler: native kernels not built"),
    pytest.mark.skipif(build.available() and not prefill_attention_available(64),
                       reason="this CPU has no AVX-512: the prefill kernel is not built"),
]


def _setup(seq_len: int, q_len: int, heads: int, kv_heads: int, d: int, block: int,
           dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // block)
    num_blocks = blocks + 3
    table = torch.randperm(num_blocks, generator=g)[:blocks]  # scattered over the pool
    k = torch.randn(seq_len, kv_heads, d, generator=g)
    v = torch.randn(seq_len, kv_heads, d, generator=g)
    make = lambda shape, dt: torch.zeros(shape, dtype=dt)  # noqa: E731
    k_cache = kv_quant.allocate((num_blocks, block, kv_heads, d), dtype, make)
    v_cache = kv_quant.allocate((num_blocks, block, kv_heads, d), dtype, make)
    slots = torch.tensor([int(table[p // block]) * block + p % block for p in range(seq_len)])
    kv_quant.write(k_cache, k, slots)
    kv_quant.write(v_cache, v, slots)
    q = torch.randn(q_len, heads, d, generator=g)
    meta = AttentionMetadata.build([q_len], [seq_len], [table.tolist()], block)
    return q, k_cache, v_cache, table, meta


def _reference(q, k_cache, v_cache, meta, scale, window=None):
    return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale, window=window)


@pytest.mark.parametrize("q_len", [1, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("context", [0, 7, 40], ids=lambda c: f"ctx{c}")
def test_chunks_equal_the_reference(q_len, context) -> None:
    seq_len = context + q_len
    q, kc, vc, table, meta = _setup(seq_len, q_len, 9, 3, 64, 16, seed=q_len + context)
    got = paged_prefill_attention(q, kc, vc, table, seq_len, 0.125)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.125), atol=2e-6, rtol=1e-5)
    into = torch.full((q_len + 2, 9, 64), 7.0)  # the rows of a bigger step's output
    assert paged_prefill_attention(q, kc, vc, table, seq_len, 0.125, out=into[1:-1]) is not None
    assert torch.equal(into[1:-1], got) and (into[0] == 7).all() and (into[-1] == 7).all()


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("d", [16, 80, 256])
@pytest.mark.parametrize("block", [16, 5, 1])
def test_shapes_and_block_sizes(heads, kv_heads, d, block) -> None:
    q, kc, vc, table, meta = _setup(45, 29, heads, kv_heads, d, block, seed=d + block)
    got = paged_prefill_attention(q, kc, vc, table, 45, d ** -0.5)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, d ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 100])
@pytest.mark.parametrize("context", [0, 50])
def test_sliding_windows(window, context) -> None:
    q_len = 70
    q, kc, vc, table, meta = _setup(context + q_len, q_len, 4, 1, 64, 16, seed=window)
    got = paged_prefill_attention(q, kc, vc, table, context + q_len, 0.125, window=window)
    ref = _reference(q, kc, vc, meta, 0.125, window=window)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    if window < context + q_len:  # the window changed something: not a no-op flag
        assert not torch.allclose(got, _reference(q, kc, vc, meta, 0.125), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=str)
def test_every_native_kv_format(dtype) -> None:
    if dtype not in kv_quant.NATIVE_CODES:
        pytest.skip(f"{dtype} is not a native KV format")
    q, kc, vc, table, meta = _setup(57, 40, 6, 2, 64, 16, dtype=dtype, seed=3)
    got = paged_prefill_attention(q, kc, vc, table, 57, 0.125)
    # both read the same stored values; only the order of float sums differs
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.125), atol=1e-5, rtol=1e-4)


def test_a_long_prompt_past_the_step_budget() -> None:
    """2,049 queries: past the default 2,048-token budget, the last work item one position."""
    q, kc, vc, table, meta = _setup(2049, 2049, 3, 1, 64, 16, seed=11)
    got = paged_prefill_attention(q, kc, vc, table, 2049, 0.125)
    torch.testing.assert_close(got, _reference(q, kc, vc, meta, 0.125), atol=2e-6, rtol=1e-5)


def test_bad_input_raises_before_c_runs() -> None:
    q, kc, vc, table, _ = _setup(40, 20, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="sequence length"):
        paged_prefill_attention(q, kc, vc, table, 10, 0.125)  # fewer keys than queries
    with pytest.raises(ValueError, match="sequence length"):
        paged_prefill_attention(q, kc, vc, table, 10_000, 0.125)  # past the table
    bad = table.clone()
    bad[0] = 999
    with pytest.raises(ValueError, match="block"):
        paged_prefill_attention(q, kc, vc, bad, 40, 0.125)
    with pytest.raises(ValueError, match="share"):
        paged_prefill_attention(torch.randn(20, 3, 64), kc, vc, table, 40, 0.125)
    with pytest.raises(ValueError, match="float32"):
        paged_prefill_attention(q.double(), kc, vc, table, 40, 0.125)
    with pytest.raises(ValueError, match="out must be"):
        paged_prefill_attention(q, kc, vc, table, 40, 0.125, out=torch.empty(20, 4, 32))
    assert paged_prefill_attention(q[:0], kc, vc, table, 40, 0.125).shape == (0, 4, 64)
    q72, kc72, vc72, t72, _ = _setup(8, 8, 2, 2, 72, 16)
    assert not prefill_attention_available(72)
    with pytest.raises(NotImplementedError):
        paged_prefill_attention(q72, kc72, vc72, t72, 8, 0.125)
