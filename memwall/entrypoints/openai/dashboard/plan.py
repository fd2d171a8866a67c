"""POST /dashboard/api/plan: the dashboard's "plan" tab asks ``memwall.planner.plan_json``.

The planner is built in a branch of its own; until it is part of this build the route answers
501 in the API's error shape, and the tab says so. It is imported on the first call only, so a
planner that is slow to import (or missing) costs the server nothing at start.

    request  {"model": ..., "dtype": ..., "kv_cache_dtype": ..., "max_model_len": ...,
              "tensor_parallel_size": ..., "pipeline_parallel_size": ..., "batch": ...,
              "gpu": ... or "device": ..., "price_per_hour": ...}
    answer   whatever plan_json returns (a JSON object: the tab renders it as a table)
"""

from __future__ import annotations

import asyncio
import importlib
from types import ModuleType

from memwall.entrypoints.openai.errors import APIError

PLANNER = "memwall.planner"


def load_planner() -> ModuleType | None:
    """The planner module, or None when this build has none. A planner that is present but
    fails to import raises: that is a bug to see, not a feature to hide."""
    try:
        return importlib.import_module(PLANNER)
    except ModuleNotFoundError as e:
        if e.name in (PLANNER, "memwall"):
            return None
        raise


async def run_plan(request: object) -> dict:
    """The planner's answer for ``request``. Raises APIError: 400 for a body that is not a JSON
    object (or that the planner rejects with ValueError), 501 without a planner."""
    if not isinstance(request, dict):
        raise APIError(400, f"the plan request must be a JSON object, got {type(request).__name__}")
    planner = load_planner()
    if planner is None:
        raise APIError(501, "the planner is not part of this build (memwall.planner is missing); "
                            "the plan tab works once it is installed", code="planner_unavailable")
    plan = await asyncio.to_thread(planner.plan_json, request)  # it may compute: not on the loop
    if not isinstance(plan, dict):
        raise APIError(500, f"memwall.planner.plan_json returned {type(plan).__name__}, not a "
                            "JSON object")
    return plan
