"""The model on its device: dtypes, placement, and the KV budget of a GPU.

    EngineArgs.device_config(cuda?)  -> DeviceConfig (cpu/cuda, compute dtype, KV dtype)
    place_model(model, dev, quant)   -> fp8 weights if asked, moved to the device
    profile_gpu_memory(...)          -> GpuMemoryProfile: one forward pass at the step's token
                                        budget, then   KV = total x utilization - peak - non-torch

On the CPU nothing here changes what the engine did before: the model stays where the loader
put it, and the KV cache is sized from free RAM (memwall/worker/kv_cache.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from memwall.attention import kv_quant
from memwall.config import DeviceConfig, ModelArchConfig, SchedulerConfig

logger = logging.getLogger("memwall")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = kv_quant.KV_DTYPES
GiB = 1 << 30


def compute_dtype(dev: DeviceConfig) -> torch.dtype:
    return DTYPES[dev.dtype]


def kv_cache_dtype(dev: DeviceConfig) -> torch.dtype:
    """The KV cache's element type (memwall/attention/kv_quant.py). ``auto``: on cuda the
    compute dtype; on the CPU with float32 compute kv_quant.CPU_AUTO (why: see there), else
    the compute dtype. cuda's triton kernels read the compute dtype and fp8 only: any other
    format is a ValueError that says so."""
    name = dev.kv_cache_dtype
    if name == "auto":
        cpu_default = not dev.is_cuda and dev.dtype == "float32"
        return KV_DTYPES[kv_quant.CPU_AUTO] if cpu_default else compute_dtype(dev)
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_DTYPES)}, got "
                         f"{name!r}")
    dtype = KV_DTYPES[name]
    if dev.is_cuda and dtype not in (torch.float8_e4m3fn, compute_dtype(dev)):
        raise ValueError(f"--kv-cache-dtype {name} is not supported on cuda (the triton kernels "
                         f"read {dev.dtype} or fp8 KV); use --kv-cache-dtype auto or fp8 there, "
                         f"or --device cpu")
    return dtype


# ---- placement ---------------------------------------------------------------------------------
def place_model(model: nn.Module, dev: DeviceConfig, quantization: str = "auto") -> nn.Module:
    """Moves the (already loaded, already in ``dev.dtype``) model to ``dev.device``; with
    ``quantization == "fp8"`` its Linears (not the lm_head) become FP8 there. Raises ValueError
    for weights that cannot run on that device (the CPU-only int8/int4/GGUF kernels on cuda)."""
    if dev.is_cuda:
        _check_cuda_weights(model)
    model.to(dev.device)  # not .to(dtype): that would widen FP8 buffers (they count as floating)
    if quantization == "fp8":
        from memwall.quant.fp8 import Fp8Linear
        from memwall.quant.transform import quantize_model
        report = quantize_model(model, Fp8Linear(), include_lm_head=False)
        logger.info("weights: %s", report.summary())
        if dev.is_cuda:
            torch.cuda.empty_cache()  # the float weights just replaced
    return model


def _check_cuda_weights(model: nn.Module) -> None:
    from memwall.quant.base import QuantLinear
    from memwall.quant.fp8 import Fp8Linear
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and not isinstance(module.method, Fp8Linear):
            raise ValueError(f"{name} holds {module.source!r} weights, which only the CPU kernels "
                             "can multiply; on cuda load with --quantization none (float weights "
                             "in --dtype) or --quantization fp8")


def loader_quantization(quantization: str) -> str:
    """What the model loader is asked for: fp8 is applied after loading, on the device."""
    return "none" if quantization == "fp8" else quantization


# ---- KV budget on a GPU ------------------------------------------------------------------------
def kv_budget_bytes(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes left for the KV cache: the engine's share of the device minus what the forward
    pass needed at its peak (weights included) and memory torch does not manage (CUDA
    context, cuBLAS workspaces, other processes). Negative when nothing is left."""
    return int(total * utilization) - peak_torch - non_torch


@dataclass(frozen=True)
class GpuMemoryProfile:
    """What the profiling pass saw, all in bytes."""

    total: int
    utilization: float
    weights: int  # allocated before the pass: parameters and buffers
    peak_torch: int  # torch's peak during the pass, the profiling KV cache excluded
    non_torch: int

    @property
    def kv_budget(self) -> int:
        return kv_budget_bytes(self.total, self.utilization, self.peak_torch, self.non_torch)

    def describe(self) -> str:
        return (f"GPU memory: {self.total / GiB:.2f} GiB x {self.utilization:.2f} = "
                f"{self.total * self.utilization / GiB:.2f} GiB for this engine; weights "
                f"{self.weights / GiB:.2f} GiB, forward peak {self.peak_torch / GiB:.2f} GiB, "
                f"non-torch {self.non_torch / GiB:.2f} GiB -> KV cache budget "
                f"{self.kv_budget / GiB:.2f} GiB")

    def check(self) -> int:
        """The budget, or a ValueError saying what to change when it is not positive."""
        if self.kv_budget <= 0:
            raise ValueError(f"{self.describe()}: no memory is left for the KV cache; raise "
                             f"--gpu-memory-utilization (now {self.utilization}), lower "
                             "--max-num-batched-tokens, or use --quantization fp8")
        return self.kv_budget


def dummy_batch(num_tokens: int, max_model_len: int, block_size: int) -> tuple[list[int], list[list[int]]]:
    """Prefill sequences covering ``num_tokens`` tokens, each at most ``max_model_len`` long,
    on consecutive blocks: (lengths, block tables)."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    tables, first = [], 0
    for n in lens:
        count = math.ceil(n / block_size)
        tables.append(list(range(first, first + count)))
        first += count
    return lens, tables


@torch.inference_mode()
def profile_gpu_memory(model: nn.Module, arch: ModelArchConfig, sched: SchedulerConfig,
                       block_size: int, kv_dtype: torch.dtype, dev: DeviceConfig,
                       backend: str) -> GpuMemoryProfile:
    """Runs one forward pass at the step's token budget (the largest a step can be), plus the
    logits and a sampler call for max_num_seqs rows, and reads torch's peak memory."""
    from memwall.attention.metadata import AttentionMetadata
    from memwall.sample.metadata import SamplingMetadata
    from memwall.sample.sampler import Sampler
    from memwall.sampling_params import SamplingParams
    from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache, bytes_per_block

    device = torch.device(dev.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    lens, tables = dummy_batch(sched.max_num_batched_tokens, sched.max_model_len, block_size)
    plan = KVCachePlan(sum(len(t) for t in tables), block_size,
                       bytes_per_block(arch, block_size, kv_dtype))
    kv = allocate_kv_cache(arch, plan, kv_dtype, device)
    torch.cuda.reset_peak_memory_stats(device)
    meta = AttentionMetadata.build(lens, lens, tables, block_size, device=device, backend=backend)
    ids = torch.zeros(sum(lens), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, kv, meta)
    rows = min(sched.max_num_seqs, hidden.shape[0])
    logits = model.compute_logits(hidden[-rows:])  # [rows, vocab] float32
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
    Sampler()(logits, SamplingMetadata.build(params, [None] * rows, [[]] * rows, [[]] * rows,
                                             [[]] * rows))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - plan.total_bytes
    del kv, hidden, logits, meta
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return GpuMemoryProfile(total, dev.gpu_memory_utilization, weights, peak, non_torch)
