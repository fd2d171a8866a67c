"""Device selection, GPU memory sizing, fp8 KV cache and fp8 weights in the engine.

CPU: config resolution, the KV-budget arithmetic on made-up numbers, and whole-engine runs
with an fp8 KV cache / fp8 weights on a tiny model, compared with float32 through prompt
logprobs (teacher forcing, chunked prefill so later chunks read the cache). Tolerance: mean
|delta logprob| below 5% of the mean |logprob| (measured ~2.5% for the KV cache, ~3% for the
weights: E4M3 rounds each element by up to 2^-4) and no token's logprob off by more than 1.5
nats (measured 0.66 and 0.89).
GPU (marked gpu): cuda vs cpu greedy parity in float32, bf16 default, the profiled budget,
swap preemption through pinned memory, seeded sampling on device generators.
"""

import random

import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.config import DeviceConfig, EngineArgs
from memwall.worker.device import GpuMemoryProfile, dummy_batch, kv_budget_bytes, place_model

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
GiB = 1 << 30


# ---------------------------------------------------------------------------- configuration

def test_auto_resolves_by_machine():
    dev = EngineArgs().device_config(cuda_available=False)
    assert (dev.device, dev.dtype, dev.kv_cache_dtype) == ("cpu", "float32", "auto")
    dev = EngineArgs().device_config(cuda_available=True)
    assert (dev.device, dev.dtype, dev.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9)
    assert EngineArgs(device="cpu").device_config(True).device == "cpu"
    assert EngineArgs(device="cuda", dtype="float16").device_config(True).dtype == "float16"


def test_bad_device_settings_say_what_to_do():
    with pytest.raises(ValueError, match="no CUDA device.*--device cpu"):
        EngineArgs(device="cuda").device_config(cuda_available=False)
    with pytest.raises(ValueError, match="'tpu'"):
        EngineArgs(device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization.*1.5"):
        EngineArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_dtype.*'int3'"):
        EngineArgs(kv_cache_dtype="int3")


def test_cli_has_the_device_flags():
    from memwall.entrypoints.cli import build_parser, engine_args_from

    args = build_parser().parse_args(["generate", "hi", "--device", "cpu", "--kv-cache-dtype",
                                      "fp8", "--gpu-memory-utilization", "0.5", "--enforce-eager"])
    engine_args = engine_args_from(args)
    assert (engine_args.device, engine_args.kv_cache_dtype, engine_args.gpu_memory_utilization,
            engine_args.enforce_eager) == ("cpu", "fp8", 0.5, True)


# ---------------------------------------------------------------------------- KV budget

def test_kv_budget_is_the_share_minus_peak_and_non_torch():
    # 80 GiB device at 0.9 = 72 GiB; 16 GiB weights + 2 GiB activations at the peak; 1 GiB context
    assert kv_budget_bytes(80 * GiB, 0.9, 18 * GiB, 1 * GiB) == 53 * GiB
    assert kv_budget_bytes(80 * GiB, 0.2, 18 * GiB, 1 * GiB) == -3 * GiB
    profile = GpuMemoryProfile(80 * GiB, 0.9, 16 * GiB, 18 * GiB, 1 * GiB)
    assert profile.check() == 53 * GiB
    assert "KV cache budget 53.00 GiB" in profile.describe()
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        GpuMemoryProfile(80 * GiB, 0.2, 16 * GiB, 18 * GiB, 1 * GiB).check()


def test_profiling_batch_covers_the_token_budget_within_the_context():
    lens, tables = dummy_batch(2048, 4096, 16)
    assert lens == [2048] and tables == [list(range(128))]
    lens, tables = dummy_batch(1000, 300, 16)
    assert lens == [300, 300, 300, 100]
    assert [len(t) for t in tables] == [19, 19, 19, 7]
    assert tables[1][0] == 19  # consecutive, non-overlapping blocks


def test_cpu_only_quantized_weights_are_refused_on_cuda():
    from torch import nn

    from memwall.quant.base import QuantLinear
    from memwall.quant.int8_cpu import Int8WeightOnly

    model = nn.Sequential(QuantLinear(Int8WeightOnly().create_weights(torch.randn(16, 32))))
    with pytest.raises(ValueError, match="--quantization none"):
        place_model(model, DeviceConfig(device="cuda"))


# ------------------------------------------------------------------- fp8 on a tiny model (CPU)

def prompt_logprobs(model_dir, **kwargs) -> torch.Tensor:
    rng = random.Random(0)
    prompt = [rng.randrange(4, 380) for _ in range(60)]
    llm = LLM(str(model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              **{"device": "cpu", **kwargs})  # the CPU unless the caller names a device
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("setting", [{"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}])
def test_fp8_engine_is_close_to_float32(tiny_model_dir, setting):
    ref = prompt_logprobs(tiny_model_dir("llama"))
    got = prompt_logprobs(tiny_model_dir("llama"), **setting)
    delta = (got - ref).abs()
    assert 0 < delta.mean() < 0.05 * ref.abs().mean(), (delta.mean(), ref.abs().mean())
    assert delta.max() < 1.5


def test_fp8_kv_cache_is_allocated_in_fp8(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_kv_blocks=16, block_size=4, kv_cache_dtype="fp8")
    k_cache = llm.engine.core.executor.worker.runner.kv_caches[0][0]
    assert k_cache.dtype == torch.float8_e4m3fn and k_cache.element_size() == 1
    assert "KV cache fp8" in llm.engine.describe()


# ---------------------------------------------------------------------------------- GPU only

def greedy(model_dir, prompts, max_tokens=24, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), num_kv_blocks=128, block_size=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


PROMPTS = [[5, 17, 99, 230, 42, 8, 150], [3, 4], list(range(10, 70))]


@gpu
@needs_cuda
def test_cuda_float32_matches_cpu_greedy(tiny_model_dir):
    path = tiny_model_dir("llama")
    assert greedy(path, PROMPTS, device="cuda", dtype="float32") == greedy(path, PROMPTS, device="cpu")


@gpu
@needs_cuda
def test_cuda_defaults_bf16_triton_and_a_profiled_budget(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="auto")
    engine = llm.engine
    worker = engine.core.executor.worker
    assert worker.device_config.dtype == "bfloat16" and worker.runner.backend == "triton"
    assert next(worker.runner.model.parameters()).device.type == "cuda"
    assert worker.gpu_memory is not None and worker.gpu_memory.kv_budget > 0
    assert "GPU memory" in engine.describe() and worker.runner.graphs is not None
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) > 0


@gpu
@needs_cuda
def test_cuda_swap_preemption_matches_unpreempted_runs(tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    path = tiny_model_dir("llama")
    alone = [greedy(path, [p], 16, device="cuda", dtype="float32")[0] for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=30, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=8, max_model_len=96, preemption_mode="swap",
              swap_space=1 << 22)
    assert llm.engine.core.executor.worker.runner.swap_caches[0][0].is_pinned()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert together == alone


@gpu
@needs_cuda
def test_cuda_seeded_sampling_ignores_batch_company(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    llm = LLM(path, device="cuda", num_kv_blocks=128, block_size=4)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0]], [other, seeded])[1].outputs[0].token_ids
    assert alone == mixed


@gpu
@needs_cuda
def test_cuda_fp8_kv_and_weights_stay_close_to_bf16(tiny_model_dir):
    path = tiny_model_dir("llama")
    ref = prompt_logprobs(path, device="cuda", dtype="bfloat16")
    for setting in ({"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}):
        got = prompt_logprobs(path, device="cuda", dtype="bfloat16", **setting)
        delta = (got - ref).abs()
        assert delta.mean() < 0.06 * ref.abs().mean(), (setting, delta.mean())
