"""A Plan as the --json document (the dashboard's plan tab reads the same): plain numbers, bytes
in bytes, times in seconds, speeds in tokens/s; null where a figure is unknown (this machine
without a calibration: no speeds)."""

from __future__ import annotations

from typing import Any

from memwall.planner.plan import Plan
from memwall.planner.precision import kv_bytes_per_token_head
from memwall.planner.roofline import DecodeStep


def plan_document(plan: Plan) -> dict[str, Any]:
    doc = {
        "model": _model(plan),
        "device": _device(plan),
        "parallel": {"tensor_parallel_size": plan.layout.tensor_parallel,
                     "pipeline_parallel_size": plan.layout.pipeline_parallel,
                     "replicas": plan.layout.replicas,
                     "stage_layers": [list(s.layers) for s in plan.memory.stages]},
        "precision": {"dtype": plan.compute, "quantization": plan.quantization,
                      "weights": plan.weights.label, "kv_cache_dtype": plan.kv_dtype},
        "memory": _memory(plan),
        "decode": _decode(plan),
        "prefill": None if plan.prefill is None else {
            "prompt_tokens": plan.prefill.prompt_tokens, "ttft_s": plan.prefill.ttft_s,
            "tokens_per_s": plan.prefill.tokens_per_s},
        "cost": None if plan.request.price_per_hour is None else {
            "price_per_hour": plan.request.price_per_hour, "devices": plan.devices,
            "usd_per_million_output_tokens": plan.usd_per_million_tokens},
        "notes": list(plan.notes),
    }
    if plan.what_ifs:
        doc["what_ifs"] = [{"what_if": text, **plan_document(p)} for text, p in plan.what_ifs]
    return doc


def _model(plan: Plan) -> dict[str, Any]:
    s = plan.model.shape
    return {"name": s.name, "source": plan.model.source, "layers": s.layers, "hidden": s.hidden,
            "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
            "intermediate": s.intermediate, "vocab": s.vocab,
            "tied_embeddings": s.tied_embeddings, "max_context": s.max_context,
            "params": s.params}


def _device(plan: Plan) -> dict[str, Any]:
    d = plan.device
    return {"name": d.name, "count": plan.devices, "memory_bytes": d.memory_bytes,
            "bandwidth_bytes_s": d.bandwidth_bytes_s, "peak_flops": dict(d.peak_flops),
            "bandwidth_efficiency": d.bandwidth_efficiency,
            "compute_efficiency": d.compute_efficiency, "is_gpu": d.is_gpu, "source": d.source}


def _memory(plan: Plan) -> dict[str, Any]:
    m, s, shape = plan.memory, plan.memory.busiest, plan.model.shape
    per_head = kv_bytes_per_token_head(plan.kv_dtype, shape.head_dim)
    whole = 2 * shape.layers * shape.kv_heads * per_head
    return {
        "capacity_bytes": m.capacity_bytes, "reserve_fraction": m.reserve_fraction,
        "usable_bytes": m.usable_bytes, "weights_bytes": plan.weights.total_bytes,
        "weights_per_rank_bytes": s.weights_bytes, "activations_bytes": s.activation_bytes,
        "kv_bytes_per_token": whole, "kv_bytes_per_token_per_rank": s.kv_bytes_per_token,
        "context_tokens": m.context_tokens,
        "kv_bytes_per_request": s.kv_bytes_per_token * m.context_tokens,
        "fits": m.fits, "max_concurrent_requests": m.max_requests,
        "max_requests_per_replica": m.max_requests_per_replica,
        "max_kv_tokens_per_replica": m.max_tokens_per_replica,
        "batch": plan.batch, "used_bytes_at_batch": m.used_at(plan.batch),
        "stages": [{"layers": list(st.layers), "weights_bytes": st.weights_bytes,
                    "kv_bytes_per_token": st.kv_bytes_per_token,
                    "activations_bytes": st.activation_bytes} for st in m.stages],
    }


def _step(step: DecodeStep) -> dict[str, Any]:
    return {"batch": step.batch, "step_s": step.step_s, "tokens_per_s": step.tokens_per_s,
            "tokens_per_s_per_sequence": step.tokens_per_s_per_sequence, "bound": step.bound}


def _decode(plan: Plan) -> dict[str, Any] | None:
    d, m = plan.decode, plan.decode_model
    if d is None or m is None:
        return None
    return {
        **_step(d), "context": d.context, "memory_s": d.memory_s, "compute_s": d.compute_s,
        "comm_s": d.comm_s, "arithmetic_intensity": d.arithmetic_intensity,
        "ridge_intensity": m.flops / m.bandwidth, "ridge_batch": plan.ridge_batch,
        "ridge_batch_weights_only": plan.ridge_batch_weights_only,
        "weights_read_per_rank_bytes": m.weights_bytes,
        "kv_bytes_per_token_per_rank": m.kv_bytes_per_token,
        "kv_read_per_rank_bytes": d.bytes - m.weights_bytes,
        "achievable_bandwidth_bytes_s": m.bandwidth, "achievable_flops": m.flops,
        "batch_1": _step(plan.decode_one),
        "curve": [_step(s) for s in plan.curve],
    }
