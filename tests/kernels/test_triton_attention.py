"""The Triton paged-attention kernels against the torch reference (memwall/attention/paged_torch.py).

Without a GPU the kernels run in Triton's interpreter on the CPU (tiny shapes: it is slow).
Tolerances: float32 atol = rtol = 1e-5 (seen: ~5e-7, the order of summation differs);
bfloat16 (GPU only) relative-norm error < 1e-2 against a float64 reference.
Every scenario draws fresh random data, fills the unused cache blocks with random values too
(so a wrong block lookup reads garbage rather than zeros) and uses scattered block tables.
"""


import pytest
import torch
from triton_support import CUDA, DEVICE, gpu, require_triton

triton = require_triton()

from memwall.attention import paged_torch, triton_backend  # noqa: E402
from memwall.attention.metadata import AttentionMetadata  # noqa: E402
from memwall.kernels.triton import paged_attention as pa  # noqa: E402


MIXED = dict(  # decode, prefill from 0, chunked prefill on a cached prefix, 1-token decode, long chunk
    q_lens=[1, 9, 6, 1, 20],
    seq_lens=[13, 9, 21, 1, 27],
)


def make_step(q_lens, seq_lens, block_size, heads, kv_heads, head_dim, dtype=torch.float32,
              device=DEVICE, seed=0, spare_blocks=5):
    """Random q/k/v for one step, a cache holding every sequence's prefix, scattered tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)  # prefixes and garbage alike
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    return q, k, v, k_cache, v_cache, meta


def reference(q, k, v, k_cache, v_cache, meta, scale, dtype=torch.float64):
    """paged_torch on upcast CPU copies: (out, k_cache, v_cache) after the step, on q's device."""
    # Rebuilt on the CPU, not copied: the metadata also holds device tensors of its own (the
    # decode batch's tables), which a cuda step's copy would keep on cuda.
    query_lens = [b - a for a, b in zip(meta.query_start, meta.query_start[1:])]
    cpu = AttentionMetadata.build(query_lens, meta.seq_lens, meta.block_tables.cpu().tolist(),
                                  meta.block_size)
    assert torch.equal(cpu.slot_mapping, meta.slot_mapping.cpu())
    kc, vc = k_cache.cpu().to(dtype), v_cache.cpu().to(dtype)
    paged_torch.write_kv(kc, vc, k.cpu().to(dtype), v.cpu().to(dtype), cpu.slot_mapping)
    out = paged_torch.paged_attention(q.cpu().to(dtype), kc, vc, cpu, scale)
    return out.to(q.device), kc.to(q.device), vc.to(q.device)


def run_backend(q, k, v, k_cache, v_cache, meta, scale, **knobs):
    triton_backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return triton_backend.paged_attention(q, k_cache, v_cache, meta, scale, **knobs)


def assert_close32(out, ref):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ KV write

def test_reshape_and_cache_matches_write_kv_on_strided_inputs():
    q_lens, seq_lens = MIXED["q_lens"], MIXED["seq_lens"]
    _, _, _, k_cache, v_cache, meta = make_step(q_lens, seq_lens, 4, 4, 2, 16, seed=1)
    qkv = torch.randn(sum(q_lens), 3, 2, 16, device=DEVICE)  # k, v as views of a fused output
    k, v = qkv[:, 1], qkv[:, 2]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    paged_torch.write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
    pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_reshape_and_cache_skips_negative_slots_and_casts_to_the_cache_dtype():
    k_cache = torch.zeros(3, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 11], device=DEVICE)
    pa.reshape_and_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[5], k[0].half()) and torch.equal(flat_v[11], v[2].half())
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # the padding token wrote nothing


# ---------------------------------------------------------------------------- the backend

@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (4, 4, 2, 32),   # GQA group 2
    (16, 4, 2, 16),  # block larger than most sequences
    (8, 2, 2, 32),   # plain multi-head
    (4, 4, 1, 24),   # group 4, head_dim not a power of two
])
def test_mixed_batch_matches_reference(block_size, heads, kv_heads, head_dim):
    step = make_step(**MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, seed=block_size + head_dim)
    q, k, v, k_cache, v_cache, meta = step
    scale = head_dim ** -0.5
    ref, ref_k, ref_v = reference(*step, scale)
    out = run_backend(*step, scale)
    assert torch.equal(k_cache, ref_k.float()) and torch.equal(v_cache, ref_v.float())
    assert_close32(out, ref)


def test_small_tiles_many_programs_and_decode_splits():
    """block_m 16 cuts the 20-token chunk into 3 programs; tile_n 16 makes several key tiles."""
    step = make_step(q_lens=[1, 1, 20, 1], seq_lens=[70, 33, 45, 5], block_size=4, heads=4,
                     kv_heads=2, head_dim=16, seed=7)
    ref, _, _ = reference(*step, 0.3)
    for splits in (1, 4):  # 4 asked, 3 used (split_len 32); the 5-token decode has empty splits
        q, k, v, k_cache, v_cache, meta = step
        out = run_backend(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3,
                          block_m=16, tile_n=16, num_splits=splits)
        assert_close32(out, ref)


def test_speculative_verification_rows_share_one_block_table():
    """A sequence's k + 1 verified tokens arrive as one-token rows over one block table with
    lengths L..L+k (worker/input_batch.py), beside other decodes and a prefill chunk; each row
    writes its own slot and attends up to its own position."""
    g = torch.Generator().manual_seed(11)
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    verify_table = [7, 2, 9, 4, 0]
    q_lens = [1] * 5 + [1, 6]
    seq_lens = [14, 15, 16, 17, 18] + [6, 12]
    tables = [verify_table] * 5 + [[1, 3], [5, 6, 8]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=DEVICE)
    shape = (10, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(DEVICE)
    v_cache = torch.randn(shape, generator=g).to(DEVICE)
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE)
    step = (q, k, v, k_cache, v_cache, meta)
    ref, _, _ = reference(*step, 0.25)
    assert_close32(run_backend(*step, 0.25), ref)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    num_seqs = int(torch.randint(1, 6, (1,), generator=g))
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        cached = int(torch.randint(0, 30, (1,), generator=g))
        q_len = 1 if torch.rand(1, generator=g) < 0.4 else int(torch.randint(2, 19, (1,), generator=g))
        q_lens.append(q_len)
        seq_lens.append(cached + q_len)
    step = make_step(q_lens, seq_lens, block_size=8, heads=4, kv_heads=2, head_dim=16, seed=seed)
    ref, _, _ = reference(*step, 0.25)
    assert_close32(run_backend(*step, 0.25, block_m=32, tile_n=16, num_splits=2), ref)


def test_every_output_row_is_written():
    q, k, v, k_cache, v_cache, meta = make_step(**MIXED, block_size=4, heads=4, kv_heads=2,
                                                head_dim=16, seed=3)
    plan = triton_backend.TritonAttentionPlan.of(meta, pa.prefill_block_q(4, 2))
    out = torch.full_like(q, float("nan"))
    pa.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    pa.decode_attention(out, q, k_cache, v_cache, meta.block_tables, plan.query_start,
                        plan.seq_lens, plan.decode_seqs, plan.max_decode_len, 0.25)
    pa.prefill_attention(out, q, k_cache, v_cache, meta.block_tables, plan.query_start,
                         plan.seq_lens, plan.prefill_work, 0.25)
    assert torch.isfinite(out).all()


def test_plan_is_built_once_per_step():
    *_, meta = make_step(**MIXED, block_size=4, heads=4, kv_heads=2, head_dim=16)
    first = triton_backend.TritonAttentionPlan.of(meta, 32)
    assert triton_backend.TritonAttentionPlan.of(meta, 32) is first
    assert first.prefill_work.tolist() == [[1, 0], [2, 0], [4, 0]]
    assert first.decode_seqs.tolist() == [0, 3] and first.max_decode_len == 13


def test_bad_shapes_are_reported():
    q, k, v, k_cache, v_cache, meta = make_step(**MIXED, block_size=4, heads=3, kv_heads=2,
                                                head_dim=16)
    with pytest.raises(ValueError, match="3 query heads cannot share 2 KV heads"):
        triton_backend.paged_attention(q, k_cache, v_cache, meta, 0.25)


# ------------------------------------------------------------------------------- real GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_mixed_batch(dtype):
    step = make_step(**MIXED, block_size=16, heads=8, kv_heads=2, head_dim=64, dtype=dtype,
                     device="cuda", seed=11)
    ref, _, _ = reference(*step, 0.125)
    out = run_backend(*step, 0.125)
    _assert_rel_err(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_llama3_8b_shapes(splits):
    """32 query heads on 8 KV heads, head_dim 128, block 16: long decodes and chunked prefills."""
    q_lens = [1] * 6 + [512, 256, 100]
    seq_lens = [1, 17, 300, 1000, 2048, 4001, 512, 1280, 2100]
    step = make_step(q_lens, seq_lens, block_size=16, heads=32, kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device="cuda", seed=5)
    ref, _, _ = reference(*step, 128 ** -0.5, dtype=torch.float32)
    out = run_backend(*step, 128 ** -0.5, num_splits=splits)
    _assert_rel_err(out, ref, 1e-2)


def _assert_rel_err(out, ref, bound):
    assert torch.isfinite(out).all()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < bound, f"relative error {err:.2e} >= {bound:.0e}"
