"""KV cache formats (memwall/attention/kv_quant.py) through the backends, the cache sizing and
the engine: fp32, fp16, bf16, int8 (a scale per 16 values of a token and KV head) and fp8
against the fp32 cache, the torch reference and the cpu backend reading the same quantized
cache, more blocks for the same bytes, and clear errors for formats that do not exist or a
device lacks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.attention import backend, kv_quant
from memwall.attention.metadata import AttentionMetadata
from memwall.config import CacheConfig, DeviceConfig, EngineArgs, ModelArchConfig
from memwall.worker.device import kv_cache_dtype
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache, plan_kv_cache

FORMATS = ["fp32", "fp16", "bf16", "int8", "fp8"]
LOSSY = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1.5e-2, "int8": 2e-2, "fp8": 6e-2}
SEQ_LENS, BLOCK = [15, 16, 17, 1], 16
TABLES = [[0], [1, 5], [2, 3], [4]]


def _cache(name: str) -> torch.Tensor:
    return kv_quant.allocate((6, BLOCK, 2, 32), kv_quant.KV_DTYPES[name],
                             lambda s, d: torch.zeros(s, dtype=d))


def _step(name: str, backend_name: str, meta_lens, seq_lens, k, v, caches, q):
    meta = AttentionMetadata.build(meta_lens, seq_lens, TABLES, BLOCK, backend=backend_name)
    backend.write_kv(*caches, k, v, meta)
    return backend.paged_attention(q, *caches, meta, 0.2)


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_then_decode_on_each_format_is_close_to_fp32(name):
    """A prefill writes the format directly, then one decode step per sequence reads it: the
    torch reference on the format against the reference on fp32, the cpu backend (its
    native decode kernel) against the reference on the same format."""
    g = torch.Generator().manual_seed(0)
    tokens = sum(SEQ_LENS)
    k, v, q = (torch.randn(tokens, 2, 32, generator=g), torch.randn(tokens, 2, 32, generator=g),
               torch.randn(tokens, 4, 32, generator=g))
    kd, vd, qd = torch.randn(4, 2, 32, generator=g), torch.randn(4, 2, 32, generator=g), torch.randn(4, 4, 32, generator=g)
    outs = {}
    for fmt, which in (("fp32", "torch"), (name, "torch"), (name, "cpu")):
        if which == "cpu" and not backend._native_available():
            continue
        caches = (_cache(fmt), _cache(fmt))
        prefill = _step(fmt, which, SEQ_LENS, SEQ_LENS, k, v, caches, q)
        decode = _step(fmt, which, [1] * 4, [n + 1 for n in SEQ_LENS], kd, vd, caches, qd)
        outs[fmt, which] = torch.cat([prefill, decode])
    ref, got = outs["fp32", "torch"], outs[name, "torch"]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < LOSSY[name]
    if (name, "cpu") in outs:
        torch.testing.assert_close(outs[name, "cpu"], got, atol=1e-5, rtol=1e-5)


def test_int8_scales_travel_with_swapped_and_copied_blocks():
    src, dst = _cache("int8"), _cache("int8")
    kv_quant.write(src, torch.randn(BLOCK, 2, 32) * 5, torch.arange(BLOCK))
    kv_quant.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([3]))
    assert torch.equal(dst[3], src[0])
    assert torch.equal(kv_quant.scales_of(dst)[3], kv_quant.scales_of(src)[0])


ARCH = ModelArchConfig.from_hf_dict(dict(
    model_type="llama", vocab_size=256, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192))  # SmolLM2-135M's shape: head_dim 64


def test_quantized_formats_fit_more_blocks_in_the_same_bytes():
    budget = CacheConfig(block_size=16, kv_cache_memory=256 << 20)
    blocks = {n: plan_kv_cache(ARCH, budget, kv_quant.KV_DTYPES[n], 1 << 30).num_blocks
              for n in FORMATS}
    assert blocks["fp16"] == blocks["bf16"] == 2 * blocks["fp32"]
    assert blocks["fp8"] == 4 * blocks["fp32"]
    # 64 one-byte codes + 4 four-byte scales (one per 16 values): 80 bytes against fp32's 256
    assert 3.15 < blocks["int8"] / blocks["fp32"] < 3.25
    plan = plan_kv_cache(ARCH, budget, torch.int8, 1 << 30)
    assert plan.bytes_per_token == 2 * 30 * 3 * (64 + 4 * 4)
    assert f"(int8, {plan.bytes_per_token} bytes/token)" in plan.describe()


def test_allocated_int8_cache_carries_zeroed_scales():
    caches = allocate_kv_cache(ARCH, KVCachePlan(2, 4, 0), torch.int8)
    k, v = caches[0]
    assert k.dtype == torch.int8 and kv_quant.scales_of(k).shape == (2, 4, 3, 4)
    assert kv_quant.scales_of(k) is not kv_quant.scales_of(v)
    assert kv_quant.scales_of(k).abs().sum() == 0


def test_unknown_formats_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*auto, fp32, fp16, bf16, int8, fp8.*'int4'"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="int4"):
        kv_cache_dtype(DeviceConfig(kv_cache_dtype="int4"))


def test_auto_and_cuda_resolution():
    assert kv_cache_dtype(DeviceConfig()) == kv_quant.KV_DTYPES[kv_quant.CPU_AUTO]
    assert kv_cache_dtype(DeviceConfig(dtype="bfloat16")) == torch.bfloat16
    assert kv_cache_dtype(DeviceConfig(kv_cache_dtype="int8")) == torch.int8
    cuda = DeviceConfig(device="cuda", dtype="bfloat16")
    assert kv_cache_dtype(cuda) == torch.bfloat16
    assert kv_cache_dtype(DeviceConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")) == torch.float8_e4m3fn
    assert kv_cache_dtype(DeviceConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="bf16")) == torch.bfloat16
    for name in ("int8", "fp16", "fp32"):
        with pytest.raises(ValueError, match=f"{name} is not supported on cuda"):
            kv_cache_dtype(DeviceConfig(device="cuda", dtype="bfloat16", kv_cache_dtype=name))


def _greedy(path, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)], llm


@pytest.mark.parametrize("name", ["int8", "fp16"])
def test_engine_greedy_output_on_a_quantized_cache_is_close_to_fp32(tiny_model_dir, name):
    """Chunked prefill (a 16-token budget) writes the format, decode steps (the fused C step
    where it builds) read it; greedy tokens mostly agree with an fp32 cache."""
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 380) for _ in range(n)] for n in (5, 17, 40)]
    ref, _ = _greedy(tiny_model_dir("llama"), prompts, kv_cache_dtype="fp32")
    got, llm = _greedy(tiny_model_dir("llama"), prompts, kv_cache_dtype=name)
    k_cache = llm.engine.core.executor.worker.runner.kv_caches[0][0]
    assert k_cache.dtype == kv_quant.KV_DTYPES[name]
    assert f"KV cache {name}" in llm.engine.describe() and "bytes/token" in llm.engine.describe()
    same = np.mean([a == b for r, g in zip(ref, got) for a, b in zip(r, g)])
    assert same >= 0.9, (same, ref, got)


def test_a_given_budget_is_kept_whole_a_chosen_one_trimmed_to_what_sequences_use():
    """Blocks past every sequence at full context hold cached prefixes only: a budget the user
    gave is kept whole (None: no trim), one chosen from free RAM is trimmed."""
    given = CacheConfig(block_size=16, kv_cache_memory=256 << 20)
    whole = plan_kv_cache(ARCH, given, torch.float16, None).num_blocks
    assert whole == (256 << 20) // (16 * 2 * 30 * 3 * 64 * 2)
    assert plan_kv_cache(ARCH, given, torch.float16, 1000).num_blocks == 63  # ceil(1000 / 16)


def test_an_engine_given_kv_bytes_keeps_them_for_its_prefix_cache(tiny_model_dir):
    """max_num_seqs=1, a 512-token context and 64 MiB of KV: all of it becomes blocks, not
    just one sequence's worth; without a budget the pool is trimmed to that."""
    from memwall import LLM

    model = tiny_model_dir("llama")
    kept = LLM(str(model), max_num_seqs=1, max_model_len=512, kv_cache_memory=64 << 20)
    per_block = kept.engine.core.executor.worker.runner.kv_caches[0][0][0].nbytes * 2 * len(
        kept.engine.core.executor.worker.runner.kv_caches)
    assert kept.engine.num_total_blocks == (64 << 20) // per_block > 512 // 16
    trimmed = LLM(str(model), max_num_seqs=1, max_model_len=512)
    assert trimmed.engine.num_total_blocks == 512 // 16
