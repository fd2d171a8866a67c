"""Capacity planning: for a model and hardware, will it fit, how fast, how many users.

Pure Python, no torch (an import-linter contract keeps it so; only memwall.planner.calibrate,
which measures this machine, may import torch). Reading order:

    shapes.py     ModelShape, parameter counts, the built-in models
    sources.py    a shape from a GGUF file, an HF directory or a name
    precision.py  bytes per weight and per KV value, as the engine stores them
    hardware.py   the GPU table, this machine, calibration files
    layout.py     tensor/pipeline parallel cuts, as memwall/distributed/ makes them
    memory.py     weights, KV, activations, reserve -> requests that fit
    roofline.py   decode and prefill speed, TP/PP costs, the ridge batch
    cost.py       $ per million tokens; what-ifs
    request.py    the inputs;  plan.py  the pipeline;  document.py / table.py / plot.py  output
"""

from __future__ import annotations

from typing import Any


def plan_json(request: dict[str, Any]) -> dict[str, Any]:
    """The ``memwall plan --json`` document for ``request``; ValueError (one line) for bad input.

    Keys (all optional; the CLI flag of each is ``--`` + the key with ``-`` for ``_``):
        model                   GGUF path, HF directory, or a built-in name (llama-3-8b,
                                qwen2.5-7b, ...); default: the embedded SmolLM2-135M GGUF
        dtype                   auto | float32 | bfloat16 | float16 (fp32/bf16/fp16 too)
        quantization            auto | none | fp8 | int8 | int4 | a GGUF type (q4_k, q8_0, ...)
        kv_cache_dtype          auto | fp32 | fp16 | bf16 | int8 | fp8
        max_model_len           context of every request (default: the model's)
        tensor_parallel_size    TP ranks (default 1)
        pipeline_parallel_size  PP stages (default 1)
        batch                   sequences in flight per replica (default: as many as fit)
        device                  "this" (this machine) or a GPU name
        gpu                     GPU kind and count: "H100", "H100x8", "8xL40S"
        price_per_hour          $ per GPU-hour (per machine-hour for "this")
        prompt_len              prompt tokens for TTFT (default min(1024, max_model_len))
        max_num_batched_tokens  step budget (default 2048)
        reserve                 share of memory held back (default 0.2)
        allreduce_us, p2p_us    TP all-reduce and PP send latency (default 12 us each)
        bandwidth_efficiency, compute_efficiency   achievable shares of peak (0.8, 0.7)
        calibration             calibration file for "this"
        what_if                 list of variants, e.g. ["kv=int8", "gpus=2"]

    The document: model, device, parallel, precision, memory (bytes; max_concurrent_requests),
    decode (seconds, tokens/s, ridge_batch, a batch curve), prefill (ttft_s, tokens_per_s),
    cost, notes, and what_ifs (one such document each); see memwall/planner/document.py.
    """
    from memwall.planner.document import plan_document
    from memwall.planner.plan import make_plan
    from memwall.planner.request import PlanRequest

    return plan_document(make_plan(PlanRequest.from_dict(request)))


__all__ = ["plan_json"]
