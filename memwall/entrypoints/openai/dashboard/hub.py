"""DashboardHub: the dashboard's Server-Sent Events stream.

Every ``interval_s`` each connected page gets one event: the shared part (stats, block map,
throughput, batching figures) and the steps that page has not seen yet. The shared part is
built at most once per tick whatever the number of pages, from what the engine thread last
published (``AsyncLLMEngine.stats`` and ``.live``): a page never calls into the engine and
never waits on it. The engine learns only that some page is open (the first opens, the last
closes: ``set_watched``), to build its block map meanwhile. With no page open nothing runs here.

An idle engine changes nothing, so then an event goes out once a second only (the throughput
still decays to zero on the page); a stream ends when the server is told to exit (uvicorn waits
for open responses, and an endless one would hold the shutdown forever).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from memwall.core.live_trace import TRACE_CAPACITY
from memwall.engine.async_engine import AsyncLLMEngine
from memwall.engine.protocol import EngineStats
from memwall.entrypoints.openai.dashboard.payload import (batching_dict, stats_dict, step_dict,
                                                          throughput, view_dict)

INTERVAL_S = 0.25
IDLE_EVENT_S = 1.0
"""With nothing new, an event at most this often."""
FIRST_STEPS = TRACE_CAPACITY
"""Steps sent to a page as it connects: the whole ring, the window its figures are over."""
MAX_STEPS_PER_EVENT = 400
_UNSET = object()


class DashboardHub:
    def __init__(self, engine: AsyncLLMEngine, interval_s: float = INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._shared: tuple[float, tuple, str] | None = None  # (built at, version, JSON)
        self.pages = 0
        """Open event streams: the engine builds its block map only while there is one."""

    def version(self) -> tuple:
        """Changes whenever anything the shared part shows may have changed."""
        live = self.engine.live
        if live is None:
            return (None, id(self.engine.stats))
        return (live.trace_id, id(self.engine.stats), id(live.view), live.last_index)

    def shared(self) -> dict:
        """The part of an event every page gets (also GET /dashboard/api/snapshot)."""
        engine, live = self.engine, self.engine.live
        steps = list(live.steps()) if live is not None else []
        info = engine.core_info
        replicas = len(getattr(getattr(engine.engine, "core", None), "replicas", ()) or ())
        return {"trace_id": live.trace_id if live is not None else None, "now": time.time(),
                "last_step": live.last_index if live is not None else -1,
                "model": engine.model_name,
                "description": info.description if info is not None else "",
                "data_parallel": max(1, replicas),
                "stats": stats_dict(self._stats()),
                "view": view_dict(live.view if live is not None else None),
                "throughput": throughput(steps), "batching": batching_dict(steps)}

    def _stats(self) -> EngineStats:
        stats = self.engine.stats
        if not stats.num_total_blocks:  # before the first step: the figures the core loaded with
            stats = getattr(self.engine.engine, "stats", stats)
        return stats

    def _shared_json(self) -> tuple[tuple, str]:
        """The shared part as JSON, built once per tick for all pages (once a second when
        nothing changes: the throughput window still moves)."""
        now, version = time.monotonic(), self.version()
        cached = self._shared
        if cached is None or (now - cached[0] >= self.interval_s / 2 and (
                version != cached[1] or now - cached[0] >= IDLE_EVENT_S)):
            cached = self._shared = (now, version, json.dumps(self.shared(), separators=(",", ":")))
        return cached[1], cached[2]

    async def stream(self, stopping: Callable[[], bool]) -> AsyncIterator[str]:
        """One page's events, as SSE text, until ``stopping()`` (or the page leaves: the
        response is cancelled then)."""
        self._opened()
        try:
            yield "retry: 2000\n\n"
            async for event in self._events(stopping):
                yield event
        finally:  # the page left (the response is cancelled), or the server stops
            self._closed()

    def _opened(self) -> None:
        self.pages += 1
        if self.pages == 1:
            self.engine.set_watched(True)

    def _closed(self) -> None:
        self.pages -= 1
        if self.pages == 0:
            self.engine.set_watched(False)

    async def _events(self, stopping: Callable[[], bool]) -> AsyncIterator[str]:
        trace_id, cursor, last = _UNSET, -1, (None, 0.0)
        while not stopping():
            version, shared = self._shared_json()
            live = self.engine.live
            live_id = live.trace_id if live is not None else None
            reset = live_id != trace_id
            if reset:  # the first event, or the engine restarted: its steps count from 0 again
                trace_id, cursor = live_id, -1
            steps = live.since(cursor) if live is not None else ()
            steps = steps[-(FIRST_STEPS if reset else MAX_STEPS_PER_EVENT):]
            if steps:
                cursor = steps[-1].index
            now = time.monotonic()
            if reset or steps or version != last[0] or now - last[1] >= IDLE_EVENT_S:
                last = (version, now)
                yield _event(shared, steps, reset)
            await asyncio.sleep(self.interval_s)


def _event(shared: str, steps, reset: bool) -> str:
    body = json.dumps([step_dict(s) for s in steps], separators=(",", ":"))
    return f'data: {{"reset":{"true" if reset else "false"},"steps":{body},"state":{shared}}}\n\n'
