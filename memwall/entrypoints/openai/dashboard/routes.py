"""The dashboard's routes (behind --api-key like /v1; see auth.py for how a browser sends it).

    GET  /dashboard                 the page (static/index.html)
    GET  /dashboard/static/<file>   its script and style sheet
    GET  /dashboard/api/events      Server-Sent Events, one every 0.25 s (hub.py)
    GET  /dashboard/api/snapshot    the same state once, as JSON (scripts, tests; its block map
                                    is null unless a page is open: only then is one built)
    POST /dashboard/api/plan        the planner (plan.py): the plan tab
    GET  /dashboard/api/prediction  the planner's decode rate for the served model (plan.py)
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from memwall.entrypoints.openai.dashboard.auth import COOKIE, PREFIX, query_key
from memwall.entrypoints.openai.dashboard.hub import DashboardHub
from memwall.entrypoints.openai.dashboard.plan import run_plan, run_prediction
from memwall.entrypoints.openai.errors import APIError

STATIC = Path(__file__).parent / "static"
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
NO_STORE = {"Cache-Control": "no-store"}


def dashboard_routes(hub: DashboardHub, served_plan: dict | None = None) -> APIRouter:
    """``served_plan``: the planner's keys for the served model (its path, KV format, parallel
    sizes, ``device: this``); the live prediction plans with them."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False)
    served = {"device": "this", **(served_plan or {})}

    @router.get("")
    async def page(raw: Request) -> Response:
        response = FileResponse(STATIC / "index.html", media_type="text/html", headers=NO_STORE)
        key = query_key(raw.scope.get("query_string", b""))
        if key is not None:  # checked by the auth middleware: the page's own requests use it
            response.set_cookie(COOKIE, key, path=PREFIX, httponly=True, samesite="strict")
        return response

    @router.get("/static/{name}")
    async def static_file(name: str) -> Response:
        if name not in FILES:
            raise APIError(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC / name, media_type=FILES[name], headers=NO_STORE)

    @router.get("/api/events")
    async def events(raw: Request) -> Response:
        server = getattr(raw.app.state, "uvicorn", None)  # set by server.uvicorn_server

        def stopping() -> bool:
            return bool(server is not None and server.should_exit)

        return StreamingResponse(hub.stream(stopping), media_type="text/event-stream",
                                 headers={**NO_STORE, "X-Accel-Buffering": "no"})

    @router.get("/api/snapshot")
    async def snapshot() -> Response:
        return JSONResponse(hub.shared(), headers=NO_STORE)

    @router.post("/api/plan")
    async def plan(raw: Request) -> Response:
        try:
            body = await raw.json()
        except ValueError as e:
            raise APIError(400, f"the plan request is not valid JSON ({e})") from None
        return JSONResponse(await run_plan(body))

    @router.get("/api/prediction")
    async def prediction(batch: int = 1, context: int = 512) -> Response:
        return JSONResponse(await run_prediction(served, batch, context), headers=NO_STORE)

    return router
