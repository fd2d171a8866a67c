"""The fused C decode step (memwall/kernels/cpu/decode.c) against the torch path it replaces."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.kernels.cpu import panels, quant_ops
from memwall.kernels.cpu.decode import NativeDecoder, paged_decode_attention
from memwall.loader.model_loader import load_model
from memwall.quant import quantize_model
from memwall.quant.packing import pack_model
from memwall.worker.cpu_decode import FusedCpuDecode
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

pytestmark = [pytest.mark.skipif(not quant_ops.available(), reason="no C compiler: native kernels not built"),
              pytest.mark.usefixtures("exact_kernels")]  # parity with torch: exact kernels
BLOCK = 4


def _scattered_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Block tables drawn at random from the pool: sequences interleave, nothing is contiguous."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(pool[:need])
        pool = pool[need:]
    return tables


def _run_steps(model, arch, prompts: list[list[int]], steps: int, native_decode: bool):
    """Prefill every prompt (torch path), then `steps` batched greedy decode steps; returns the
    hidden states of each decode step and the final caches."""
    total = [len(p) + steps for p in prompts]
    tables = _scattered_tables(total, sum(-(-n // BLOCK) for n in total) + 3, seed=1)
    caches = allocate_kv_cache(arch, KVCachePlan(len(tables) and max(max(t) for t in tables) + 1,
                                                 BLOCK, 0), torch.float32)
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    hidden = model(ids, pos, caches, meta)
    ends = torch.tensor(meta.query_start[1:]) - 1
    tokens = model.compute_logits(hidden[ends]).argmax(-1)
    outs = []
    fused = FusedCpuDecode.build(model, caches) if native_decode else None
    if native_decode:
        assert fused is not None, "the native decoder did not accept this model"
    for _ in range(steps):
        meta = AttentionMetadata.build([1] * len(prompts), [n + 1 for n in lens], tables, BLOCK)
        if fused is not None:  # the runner's fast path: all layers in one C call
            assert fused.can_run(meta)
            hidden = fused.run(tokens, torch.tensor(lens), meta)
        else:  # the model's forward on the torch reference backend
            hidden = model(tokens, torch.tensor(lens), caches, meta)
        outs.append(hidden.clone())
        tokens = model.compute_logits(hidden).argmax(-1)
        lens = [n + 1 for n in lens]
    return outs, caches


def _prompts(vocab: int, lengths=(5, 17, 1 + 2, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_native_decode_matches_torch(tiny_model_dir, kind, quant):
    loaded = load_model(str(tiny_model_dir(kind)))
    model = loaded.model
    if quant:
        model = copy.deepcopy(model)
        quantize_model(model, quant)
    prompts = _prompts(loaded.arch.vocab_size)
    ref, ref_caches = _run_steps(model, loaded.arch, prompts, 6, native_decode=False)
    got, got_caches = _run_steps(model, loaded.arch, prompts, 6, native_decode=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for (rk, rv), (gk, gv) in zip(ref_caches, got_caches):  # same K/V written to the same slots
        torch.testing.assert_close(gk, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv, rv, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("quant", [None, "int4"])
def test_native_decode_computes_gemma3_across_its_window(tiny_model_dir, quant):
    """Sandwich norms, GeGLU, scaled embeddings, local and global rope tables; the tiny config's
    window is 8 tokens: sequences start inside it and decode past it (the sliding layers then
    attend their last 8 keys in C), one of them past a 128-key split of the attention."""
    loaded = load_model(str(tiny_model_dir("gemma3")))
    model = loaded.model
    if quant:
        model = copy.deepcopy(model)
        quantize_model(model, quant)
    prompts = _prompts(loaded.arch.vocab_size, (2, 1, 6, 126))
    ref, _ = _run_steps(model, loaded.arch, prompts, 9, native_decode=False)
    got, caches = _run_steps(model, loaded.arch, prompts, 9, native_decode=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    fused = FusedCpuDecode.build(model, caches)
    assert fused.can_run(AttentionMetadata.build([1], [9], [[0, 1, 2]], BLOCK))


def test_gemma2_softcaps_keep_the_model_path(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("gemma2")))
    caches = allocate_kv_cache(loaded.arch, KVCachePlan(8, BLOCK, 0), torch.float32)
    assert FusedCpuDecode.build(loaded.model, caches) is None


@torch.inference_mode()
def test_native_decode_on_the_embedded_gguf(gguf_path):
    loaded = load_model(str(gguf_path))  # Q4_1 + Q8_0 head kept quantized
    prompts = _prompts(loaded.arch.vocab_size, (12, 30, 7))
    ref, _ = _run_steps(loaded.model, loaded.arch, prompts, 8, native_decode=False)
    got, _ = _run_steps(loaded.model, loaded.arch, prompts, 8, native_decode=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)


@torch.inference_mode()
@pytest.mark.skipif(not panels.available(), reason="needs the AVX-512 VNNI kernels (packed panels)")
def test_native_decode_on_packed_panels_past_16_rows(gguf_path):
    """20 sequences: decode.c multiplies a packed weight 16 rows a call (then 4), writing each
    chunk's rows into the projection's output at their stride; the torch path takes all 20 at
    once. Both on the packed weights, the tied embedding reading the panels' rows."""
    loaded = load_model(str(gguf_path))
    assert pack_model(loaded.model).layers
    prompts = _prompts(loaded.arch.vocab_size, tuple(3 + i for i in range(20)))
    ref, _ = _run_steps(loaded.model, loaded.arch, prompts, 4, native_decode=False)
    got, _ = _run_steps(loaded.model, loaded.arch, prompts, 4, native_decode=True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)


def test_paged_decode_attention_reads_blocks_in_place():
    """Against softmax attention over each sequence's gathered keys (GQA 6 heads on 2)."""
    g = torch.Generator().manual_seed(3)
    lengths, heads, kv_heads, dim = [1, 7, 13, 4], 6, 2, 16
    tables = _scattered_tables(lengths, 16, seed=5)
    width = max(len(t) for t in tables)
    k_cache = torch.randn(16, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(16, BLOCK, kv_heads, dim, generator=g)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lengths), 0.25)
    for b, (n, table) in enumerate(zip(lengths, tables)):
        k = k_cache[table].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * 0.25, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("ht,thd->hd", p, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 8, 100, 129, 512])
def test_paged_decode_attention_with_a_window(window):
    """A sliding layer's rows attend their last `window` keys (a query at position p sees
    p - window + 1 .. p), across 128-key splits and block edges; a window longer than the
    context changes nothing."""
    g = torch.Generator().manual_seed(window)
    lengths, heads, kv_heads, dim = [1, 7, 9, 130, 300, 257], 4, 2, 16
    blocks = sum(-(-n // BLOCK) for n in lengths) + 2
    tables = _scattered_tables(lengths, blocks, seed=window)
    width = max(len(t) for t in tables)
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    q = torch.randn(len(lengths), heads, dim, generator=g)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lengths), 0.25, window=window)
    for b, (n, table) in enumerate(zip(lengths, tables)):
        first = max(0, n - window)
        k = k_cache[table].flatten(0, 1)[first:n].repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].flatten(0, 1)[first:n].repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * 0.25, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("ht,thd->hd", p, v), atol=1e-5, rtol=1e-5)
    # one row alone gives the same bits as in the batch
    alone = paged_decode_attention(q[4:5], k_cache, v_cache, bt[4:5], torch.tensor(lengths[4:5]),
                                   0.25, window=window)
    assert torch.equal(alone[0], out[4])


def test_unsupported_models_fall_back(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")), dtype="bfloat16")
    caches = allocate_kv_cache(loaded.arch, KVCachePlan(4, BLOCK, 0), torch.bfloat16)
    assert NativeDecoder.build(loaded.model, caches) is None


def test_mixed_step_decode_rows_use_the_native_kernel():
    """A step with prefill chunks and decodes: the CPU backend's native decode rows equal the
    torch reference's gathered ones, and the prefill rows are untouched."""
    from memwall.attention import backend, paged_torch

    g = torch.Generator().manual_seed(7)
    query_lens, seq_lens = [1, 5, 1, 1], [9, 12, 3, 14]
    tables = _scattered_tables(seq_lens, 20, seed=2)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, backend="cpu")
    k_cache = torch.randn(20, BLOCK, 2, 8, generator=g)
    v_cache = torch.randn(20, BLOCK, 2, 8, generator=g)
    q = torch.randn(sum(query_lens), 4, 8, generator=g)
    calls = []
    original = backend._native_decode

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    backend._native_decode = spy
    try:
        got = backend.paged_attention(q, k_cache, v_cache, meta, 0.3)
    finally:
        backend._native_decode = original
    ref = paged_torch.paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert calls == [1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_release_caller_pool_keeps_torch_working():
    """After the calling thread's OpenMP pool is freed, parallel work still runs (a new pool is
    made on demand) and gives the same result."""
    from memwall.kernels.cpu.threads import release_caller_pool

    a = torch.randn(256, 256)
    before = a @ a
    assert release_caller_pool() in (True, False)
    torch.testing.assert_close(a @ a, before)
