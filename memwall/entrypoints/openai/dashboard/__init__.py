"""The live dashboard of ``memwall serve`` (GET /dashboard): plain HTML, JS and CSS in static/,
fed over Server-Sent Events from the engine's own per-step records (memwall/core/live_trace.py).

    payload.py  EngineStats + LiveTrace -> JSON-ready dicts (throughput, batching, block map)
    hub.py      the SSE stream: one event per tick, the shared part built once per tick
    auth.py     the API key for browser routes (query parameter, then a cookie)
    plan.py     POST /dashboard/api/plan -> memwall.planner.plan_json (501 while it is absent)
    routes.py   the routes
"""
