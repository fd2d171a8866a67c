"""CUDA graphs for decode (memwall/worker/cuda_graphs.py).

On the CPU: the bucket choice, the padding of the static buffers, and the graph's attention
path itself (static metadata + device-sized decode splits) run eagerly under Triton's
interpreter against the torch reference, float32 atol = rtol = 1e-5 (as tests/kernels).
On a GPU (marked gpu): capture and replay against the eager forward pass, and whole-engine
greedy tokens with graphs vs --enforce-eager.
"""

import os

import pytest
import torch

from memwall.attention import paged_torch
from memwall.attention.metadata import AttentionMetadata
from memwall.worker.cuda_graphs import BUCKETS, StaticDecodeBuffers, batch_buckets, bucket_for

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


# ---------------------------------------------------------------------------- buckets, padding

def test_buckets_stop_at_max_num_seqs_and_include_it():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(1) == [1]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1000) == list(BUCKETS)  # capped at the largest bucket (128)


def test_bucket_for_picks_the_smallest_that_fits():
    buckets = batch_buckets(48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert bucket_for(49, buckets) is None  # larger batches run eagerly
    assert bucket_for(0, buckets) is None


def test_load_writes_rows_and_pads_the_rest_of_the_bucket():
    buf = StaticDecodeBuffers(max_rows=8, max_blocks=6, device="cpu")
    # a previous, larger step left real values in rows 0..5
    buf.load(torch.arange(6) + 100, torch.arange(6) + 50, torch.arange(6) + 10,
             torch.full((6,), 40, dtype=torch.int32), torch.full((6, 5), 3), bucket=8)
    buf.load(torch.tensor([7, 8, 9]), torch.tensor([20, 31, 5]), torch.tensor([81, 125, 6]),
             torch.tensor([21, 32, 6], dtype=torch.int32),
             torch.tensor([[5, 1], [7, 2], [1, 0]]), bucket=4)
    assert buf.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert buf.positions[:4].tolist() == [20, 31, 5, 0]
    assert buf.slot_mapping[:4].tolist() == [81, 125, 6, -1]  # padding writes no KV
    assert buf.seq_lens[:4].tolist() == [21, 32, 6, 1]  # padding attends one key
    assert buf.block_tables[:3, :2].tolist() == [[5, 1], [7, 2], [1, 0]]
    assert buf.block_tables[3].tolist() == [0] * 6
    meta = buf.metadata(bucket=4, block_size=16, max_model_len=96, num_splits=2)
    assert meta.decode_seq_ids == [0, 1, 2, 3] and not meta.prefill_seq_ids
    assert meta.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()  # views, not copies


def test_load_refuses_what_does_not_fit():
    buf = StaticDecodeBuffers(max_rows=4, max_blocks=2, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        buf.load(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                 torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.int32),
                 torch.zeros(3, 3, dtype=torch.long), bucket=4)  # 3 blocks > 2


# --------------------------------------------------- the graph's attention path, run eagerly

def _triton_or_skip():
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")
    if not CUDA and type(triton.language.standard.max).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")


def decode_step(seq_lens, block_size=4, kv_heads=2, heads=4, head_dim=16, seed=0):
    """Random caches with scattered block tables for a decode-only step."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    n = len(seq_lens)
    q = torch.randn(n, heads, head_dim, generator=g)
    k, v = torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g)
    return tables, [t.to(DEVICE) for t in (q, k, v, k_cache, v_cache)]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_static_plan_with_padding_matches_reference(num_splits):
    _triton_or_skip()
    from memwall.attention import triton_backend

    seq_lens, block_size, max_len = [13, 1, 40, 7, 29], 4, 64
    tables, (q, k, v, k_cache, v_cache) = decode_step(seq_lens, block_size, seed=num_splits)
    meta = AttentionMetadata.build([1] * 5, seq_lens, tables, block_size, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    paged_torch.write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
    ref = paged_torch.paged_attention(q, ref_k, ref_v, meta, 0.25)

    buf = StaticDecodeBuffers(max_rows=8, max_blocks=max_len // block_size, device=DEVICE)
    static = buf.metadata(bucket=8, block_size=block_size, max_model_len=max_len, num_splits=num_splits)
    buf.load(torch.zeros(5, dtype=torch.long, device=DEVICE), torch.zeros(5, dtype=torch.long, device=DEVICE),
             meta.slot_mapping, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
             meta.block_tables, bucket=8)
    pad = lambda x: torch.cat([x, torch.randn(3, *x.shape[1:], device=DEVICE)])  # noqa: E731
    triton_backend.write_kv(k_cache, v_cache, pad(k), pad(v), static.slot_mapping)
    out = triton_backend.paged_attention(pad(q), k_cache, v_cache, static, 0.25)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # padding wrote nothing
    torch.testing.assert_close(out[:5], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[5:]).all()


def test_dynamic_split_decode_matches_host_sized_splits():
    """The graph-safe kernel variant sizes splits per sequence; results must not change.
    max_seq_len is passed far too small (16): only per-sequence sizing reaches every key."""
    _triton_or_skip()
    from memwall.attention import triton_backend
    from memwall.kernels.triton import paged_attention as pa

    seq_lens = [70, 3, 33, 64]
    tables, (q, k, v, k_cache, v_cache) = decode_step(seq_lens, block_size=8, seed=11)
    meta = AttentionMetadata.build([1] * 4, seq_lens, tables, 8, device=DEVICE)
    plan = triton_backend.TritonAttentionPlan.build(meta, 16)
    ref = paged_torch.paged_attention(q, k_cache, v_cache, meta, 0.3)
    for splits in (1, 2, 5):
        out = torch.empty_like(q)
        pa.decode_attention(out, q, k_cache, v_cache, meta.block_tables, plan.query_start,
                            plan.seq_lens, plan.decode_seqs, 16, 0.3, num_splits=splits,
                            tile_n=16, dynamic_split=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- GPU only

@gpu
@needs_cuda
def test_graph_replay_matches_eager_forward(tiny_model_dir):
    from memwall.loader.model_loader import load_model
    from memwall.worker.cuda_graphs import CudaGraphRunner
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache, bytes_per_block

    loaded = load_model(str(tiny_model_dir("llama")), "float32")
    model, arch = loaded.model.to("cuda"), loaded.arch
    plan = KVCachePlan(64, 4, bytes_per_block(arch, 4, torch.float32))
    kv = allocate_kv_cache(arch, plan, torch.float32, "cuda")
    for layer in kv:
        for t in layer:
            t.normal_()
    graphs = CudaGraphRunner(model, kv, arch.num_key_value_heads, 8, 96, 4, "cuda")
    graphs.capture()
    seq_lens = [9, 30, 17]
    tables = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24]]
    ids = torch.tensor([5, 77, 300], device="cuda")
    pos = torch.tensor([s - 1 for s in seq_lens], device="cuda")
    with torch.inference_mode():
        eager_kv = [(k.clone(), v.clone()) for k, v in kv]
        meta = AttentionMetadata.build([1] * 3, seq_lens, tables, 4, device="cuda", backend="triton")
        eager = model(ids, pos, eager_kv, meta)
        assert graphs.can_run(meta)
        replayed = graphs.run(ids, pos, meta).clone()
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    for (k, v), (ek, ev) in zip(kv, eager_kv):
        assert torch.equal(k, ek) and torch.equal(v, ev)  # same KV writes, none from padding


@gpu
@needs_cuda
def test_engine_tokens_same_with_and_without_graphs(tiny_model_dir):
    from memwall import LLM, SamplingParams

    prompts = [[5, 17, 99, 230, 42], [8, 150, 3], list(range(4, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = LLM(str(tiny_model_dir("llama")), device="cuda", dtype="float32", num_kv_blocks=128,
                  block_size=4, max_num_seqs=4, enforce_eager=eager)
        graphs = llm.engine.core.executor.worker.runner.graphs
        assert (graphs is not None and graphs.buckets == [1, 2, 4]) != eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
