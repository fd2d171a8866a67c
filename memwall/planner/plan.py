"""One plan: a PlanRequest resolved (model, device, formats, layout) and run through memory,
roofline and cost. ``make_plan`` is the whole pipeline; memwall/planner/document.py turns a
Plan into the --json document and table.py into the human table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from memwall.planner.cost import apply_what_if, usd_per_million_tokens
from memwall.planner.hardware import Device, parse_gpus
from memwall.planner.host import HostTerms, cpu_weights, host_terms
from memwall.planner.layout import Layout, rank_share
from memwall.planner.memory import MemoryPlan, Weights, model_weights, plan_memory
from memwall.planner.precision import (QUANTIZATIONS, compute_dtype, kv_bytes_per_token_head,
                                       kv_cache_dtype, precision)
from memwall.planner.request import PlanRequest
from memwall.planner.roofline import (DecodeStep, Prefill, StepModel, batch_curve, decode_step,
                                      prefill, ridge_batch)
from memwall.planner.sources import ModelSource, resolve_model

DEFAULT_PROMPT = 1024


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    model: ModelSource
    device: Device
    """One rank's device (a host's share when ranks share this machine)."""
    devices: int
    """Devices paid for: GPUs, or 1 for this machine."""
    layout: Layout
    compute: str
    quantization: str
    kv_dtype: str
    weights: Weights
    memory: MemoryPlan
    context: int
    batch: int
    prompt: int
    decode_model: StepModel | None
    prefill_model: StepModel | None
    decode: DecodeStep | None
    decode_one: DecodeStep | None
    curve: list[DecodeStep]
    ridge_batch: float | None
    ridge_batch_weights_only: float | None
    prefill: Prefill | None
    usd_per_million_tokens: float | None
    notes: list[str]
    what_ifs: list[tuple[str, "Plan"]] = field(default_factory=list)


def make_plan(request: PlanRequest, with_what_ifs: bool = True) -> Plan:
    model = resolve_model(request.model)
    device, devices, layout = _device_and_layout(request)
    notes: list[str] = []
    compute = compute_dtype(request.dtype, device.is_gpu)
    quant = _quantization(request.quantization)
    kv = kv_cache_dtype(request.kv_cache_dtype, compute, device.is_gpu)
    context = _context(request, model, notes)
    weights = model_weights(model, compute, quant)
    memory = plan_memory(model, weights, layout, kv, precision(compute).bytes_per_value,
                         device.memory_bytes, context, request.reserve,
                         request.max_num_batched_tokens)
    batch = request.batch or max(1, memory.max_requests_per_replica)
    prompt = min(request.prompt_len or DEFAULT_PROMPT, context)
    notes += _memory_notes(memory, batch, context)
    notes += _engine_notes(model, device, quant, kv, compute)
    step, prefill_step = _step_models(request, model, weights, device, layout, kv, compute,
                                      quant, notes)
    plan = Plan(request, model, device, devices, layout, compute, quant, kv, weights, memory,
                context, batch, prompt, step, prefill_step, None, None, [], None, None, None,
                None, notes)
    if step is not None:
        plan = _speeds(plan, step, prefill_step)
    if with_what_ifs:
        plan.what_ifs.extend((text, _what_if(request, text)) for text in request.what_if)
    return plan


def _what_if(request: PlanRequest, text: str) -> Plan:
    try:
        return make_plan(apply_what_if(request, text), with_what_ifs=False)
    except ValueError as e:
        raise ValueError(f"what-if {text!r}: {e}") from None


def _device_and_layout(request: PlanRequest) -> tuple[Device, int, Layout]:
    tp, pp = request.tensor_parallel_size, request.pipeline_parallel_size
    if request.on_host:
        host = Device.this_machine(request.calibration)
        layout = Layout(tp, pp, tp * pp)  # every rank on this one host
        device, devices = host.shared_by(layout.ranks), 1
    else:
        spec, count = parse_gpus(request.gpu_text)
        device, devices, layout = Device.from_gpu(spec), count, Layout(tp, pp, count)
    efficiencies = {"bandwidth_efficiency": request.bandwidth_efficiency,
                    "compute_efficiency": request.compute_efficiency}
    device = replace(device, **{k: v for k, v in efficiencies.items() if v is not None})
    return device, devices, layout


def _quantization(name: str) -> str:
    low = name.strip().lower()
    if low not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    return low if low in ("auto", "none") else precision(low).name


def _context(request: PlanRequest, model: ModelSource, notes: list[str]) -> int:
    longest = model.shape.max_context
    if request.max_model_len and request.max_model_len > longest:
        notes.append(f"max_model_len {request.max_model_len} is capped at the model's "
                     f"{longest} tokens, as the engine caps it")
    return min(request.max_model_len or longest, longest)


def _step_models(request: PlanRequest, model: ModelSource, weights: Weights, device: Device,
                 layout: Layout, kv: str, compute: str, quant: str,
                 notes: list[str]) -> tuple[StepModel | None, StepModel | None]:
    """The roofline's inputs for decode and for prefill (their FLOP/s kinds may differ)."""
    bandwidth = device.achievable_bandwidth
    quantized = quant not in ("auto", "none") or _gguf_quantized(model, quant)
    decode_kinds, prefill_kinds = _flops_kinds(device, compute, quant, quantized)
    decode_flops = device.achievable_flops(decode_kinds)
    prefill_flops = device.achievable_flops(prefill_kinds)
    if device.elsewhere:
        notes.append(f"this machine's calibration may not fit: {device.elsewhere}; rerun memwall "
                     "plan --device this --calibrate")
    if bandwidth is None or decode_flops is None:
        notes.append("no calibration for this machine: memory only; run memwall plan --device "
                     "this --calibrate for speeds")
        return None, None
    if decode_flops[1] != decode_kinds[0]:
        notes.append(f"{device.name} lists no {decode_kinds[0]} peak: {decode_flops[1]}'s is used")
    shape, share = model.shape, rank_share(model.shape, layout.tensor_parallel)
    ranks, pp = layout.ranks, layout.pipeline_parallel
    kv_r = 2 * shape.layers * share.kv_heads * kv_bytes_per_token_head(kv, shape.head_dim) / pp
    base = StepModel(weights.total_bytes / ranks, kv_r, shape.matmul_params / ranks,
                     4 * shape.heads * shape.head_dim * shape.layers / ranks, bandwidth,
                     decode_flops[0], layout, shape.layers, request.allreduce_us * 1e-6,
                     request.p2p_us * 1e-6, shape.vocab * shape.hidden / ranks)
    prefill_step = replace(base, flops=prefill_flops[0])
    terms = host_terms(device, cpu_weights(model, quant), shape, shape.layers // pp, ranks)
    if terms is None:
        return base, prefill_step
    return _with_host(base, prefill_step, terms)


def _with_host(decode: StepModel, prefill: StepModel,
               terms: HostTerms) -> tuple[StepModel, StepModel]:
    """The step models with a calibrated CPU's terms (memwall/planner/host.py)."""
    decode = replace(decode, weight_read_s=terms.weight_read_s, host_s=terms.decode_host_s)
    prefill = replace(prefill, host_s=terms.prefill_host_s, host_token_s=terms.prefill_token_s,
                      chunk_matmuls=terms.prefill_matmul_s, attention_flops=terms.attention_flops,
                      masked_chunks=True)
    return decode, prefill


def _flops_kinds(device: Device, compute: str, quant: str,
                 quantized: bool) -> tuple[list[str], list[str]]:
    """Which peak FLOP/s a decode and a prefill step run at, best first: GPU tensor cores at
    fp8 for fp8 weights, else at bf16 (fp16's peak is the same); on the CPU the calibrated int8
    decode kernels for quantized weights, whose prefill dequantizes to the compute dtype."""
    if device.is_gpu:
        kinds = ["fp8", "bf16"] if quant == "fp8" else ["bf16" if compute == "fp16" else compute,
                                                         "bf16"]
        return kinds, kinds
    return (["int8_decode", compute] if quantized else [compute]), [compute]


def _gguf_quantized(model: ModelSource, quant: str) -> bool:
    if quant != "auto" or model.gguf is None:
        return False
    return any(t not in ("F32", "F16", "BF16") for t in model.gguf.types)


def _speeds(plan: Plan, step: StepModel, prefill_step: StepModel) -> Plan:
    decode = decode_step(step, plan.batch, plan.context)
    ridge = ridge_batch(step, plan.context)
    largest = max(plan.batch, plan.memory.max_requests_per_replica)
    if ridge is not None and ridge < 65536:
        largest = max(largest, math.ceil(ridge * 1.5))
    usd = None
    if plan.request.price_per_hour is not None:
        usd = usd_per_million_tokens(plan.request.price_per_hour, plan.devices, decode.tokens_per_s)
    return replace(plan, decode=decode, decode_one=decode_step(step, 1, plan.context),
                   curve=batch_curve(step, plan.context, largest), ridge_batch=ridge,
                   ridge_batch_weights_only=ridge_batch(step, 0),
                   prefill=prefill(prefill_step, plan.prompt, plan.request.max_num_batched_tokens),
                   usd_per_million_tokens=usd)


def _memory_notes(memory: MemoryPlan, batch: int, context: int) -> list[str]:
    gb = 1e9
    if not memory.fits:
        s = memory.busiest
        return [f"does not fit: weights {s.weights_bytes / gb:.2f} GB + activations "
                f"{s.activation_bytes / gb:.2f} GB per rank exceed the usable "
                f"{memory.usable_bytes / gb:.2f} GB; add GPUs (--tensor-parallel-size), "
                "quantize (--quantization) or pick a larger device"]
    if batch > memory.max_requests_per_replica:
        return [f"batch {batch} needs {memory.used_at(batch) / gb:.1f} GB per rank: only "
                f"{memory.max_requests_per_replica} requests of {context} tokens fit"]
    return []


def _engine_notes(model: ModelSource, device: Device, quant: str, kv: str,
                  compute: str) -> list[str]:
    """Where memwall itself would refuse the configuration (memwall/worker/device.py)."""
    notes = []
    if device.is_gpu and (quant in ("int8", "int4") or precision_kind(quant) == "gguf"
                          or _gguf_quantized(model, quant)):
        notes.append("memwall runs int8/int4/GGUF-quantized weights on the CPU only: on a GPU "
                     "use --quantization none or fp8")
    if device.is_gpu and kv not in (compute, "fp8"):
        notes.append(f"memwall's GPU attention reads {compute} or fp8 KV, not {kv}")
    if device.is_gpu and quant == "fp8" and "fp8" not in device.peak_flops:
        notes.append(f"{device.name} has no fp8 tensor cores: fp8 weights are dequantized")
    return notes


def precision_kind(quant: str) -> str:
    return "" if quant in ("auto", "none") else precision(quant).kind
