"""What it costs, and what-ifs: the same plan with a few inputs changed, side by side.

    $ / 1M output tokens = price per device-hour x devices / (decode tokens/s x 3600) x 1e6

at the planned batch (all replicas). Prefill is not charged separately: a server's devices
spend that time too, so this is the decode-only floor. Llama-3-70B on 8 x H100 at TP=8, B=64,
2048 tokens (roofline.py's example) at $2.50 per GPU-hour: 8 x 2.50 / (6,092 x 3600) x 1e6 =
$0.91 per million output tokens; at TP=4 x PP=2 (3,740 tok/s) $1.49.

A what-if is ``key=value[,key=value...]``; keys are the plan's own (PlanRequest fields) or
these short forms:

    kv      kv_cache_dtype          tp    tensor_parallel_size     ctx     max_model_len
    quant   quantization            pp    pipeline_parallel_size   prompt  prompt_len
    gpus    the GPU count (H100x8 with gpus=16 -> H100x16)         price   price_per_hour
    gpu     the GPU kind, keeping the count (gpu=H200)
"""

from __future__ import annotations

from dataclasses import fields

from memwall.planner.request import PlanRequest

SHORT_KEYS = {"kv": "kv_cache_dtype", "quant": "quantization", "tp": "tensor_parallel_size",
              "pp": "pipeline_parallel_size", "ctx": "max_model_len", "prompt": "prompt_len",
              "price": "price_per_hour"}


def usd_per_million_tokens(price_per_hour: float, devices: int,
                           tokens_per_s: float) -> float | None:
    if tokens_per_s <= 0:
        return None
    return price_per_hour * devices / (tokens_per_s * 3600) * 1e6


def parse_what_if(text: str) -> dict[str, str]:
    """``kv=int8,gpus=2`` -> {"kv": "int8", "gpus": "2"}; ValueError for a malformed item."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"what-if {text!r}: write key=value[,key=value], e.g. kv=int8,gpus=2")
        out[key.strip().lower().replace("-", "_")] = value.strip()
    if not out:
        raise ValueError("an empty what-if: write key=value, e.g. kv=int8")
    return out


def apply_what_if(request: PlanRequest, text: str) -> PlanRequest:
    """``request`` with the what-if's changes (and no what-ifs of its own)."""
    known = {f.name for f in fields(PlanRequest)} - {"what_if"}
    changes: dict[str, str] = {}
    for key, value in parse_what_if(text).items():
        if key in ("gpus", "gpu"):
            changes["gpu"] = _gpu_change(request, key, value)
            continue
        name = SHORT_KEYS.get(key, key)
        if name not in known:
            raise ValueError(f"what-if key {key!r} is unknown; use {', '.join(SHORT_KEYS)}, gpus, "
                             f"gpu or a plan key ({', '.join(sorted(known))})")
        changes[name] = value
    values = {f.name: getattr(request, f.name) for f in fields(PlanRequest)}
    values.update(changes, what_if=())
    if "gpu" in changes:
        values["device"] = None
    return PlanRequest.from_dict(values)


def _gpu_change(request: PlanRequest, key: str, value: str) -> str:
    from memwall.planner.hardware import parse_gpus

    if request.gpu_text is None:
        if key == "gpus":
            raise ValueError("what-if gpus=N needs a GPU plan (--gpu NAME); this machine is "
                             "one host")
        return value
    spec, count = parse_gpus(request.gpu_text)
    if key == "gpu":
        return f"{value}x{count}"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"what-if gpus={value!r}: give a count >= 1")
    return f"{spec.name}x{value}"
