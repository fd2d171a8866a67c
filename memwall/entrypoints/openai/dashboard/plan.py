"""The dashboard's use of the planner (memwall/planner): the "plan" tab's free-form plans, and
the live panel's prediction for the model being served.

    POST /dashboard/api/plan        {"model", "dtype", "kv_cache_dtype", "max_model_len",
                                     "tensor_parallel_size", "pipeline_parallel_size", "batch",
                                     "gpu" or "device", "price_per_hour", ...}
                                    -> memwall.planner.plan_json's document
    GET  /dashboard/api/prediction?batch=B&context=C
                                    -> {"batch", "context", "tokens_per_s", "bound", "device",
                                        "notes"}: the served model on this machine (its
                                        calibration), B sequences decoding at C tokens of context

The planner is imported on the first call only: the server's start pays nothing for it. It
computes for milliseconds, so it runs in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio

from memwall.entrypoints.openai.errors import APIError


async def run_plan(request: object) -> dict:
    """The planner's answer for ``request``; APIError 400 for a body that is not a JSON object
    or that the planner rejects (its ValueError's one line)."""
    if not isinstance(request, dict):
        raise APIError(400, f"the plan request must be a JSON object, got {type(request).__name__}")
    from memwall.planner import plan_json
    try:
        return await asyncio.to_thread(plan_json, request)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def run_prediction(served: dict, batch: int, context: int) -> dict:
    """The planner's decode rate for the served model (``served``: the plan keys the server
    knows: model path, KV format, parallel sizes, this machine) at ``batch`` sequences of
    ``context`` tokens. ``tokens_per_s`` is None while this machine has no calibration (the
    notes say how to make one)."""
    if batch < 1 or context < 1:
        raise APIError(400, f"batch and context must be positive, got {batch} and {context}")
    plan = await run_plan({**served, "batch": batch, "max_model_len": context})
    decode = plan.get("decode") or {}
    return {"batch": batch, "context": context, "tokens_per_s": decode.get("tokens_per_s"),
            "bound": decode.get("bound"), "device": plan.get("device"),
            "notes": plan.get("notes", [])}
