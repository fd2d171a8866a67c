"""The live dashboard's data path: the engine core records, the API side keeps a ring.

    engine core (its own process)                      API process
    ─────────────────────────────                      ───────────
    step() -> TraceRecorder.record(StepRecord)      (always: ~10 us, and pages get history)
              TraceRecorder.maybe_view()            (<= 4/s, only while a page is open)
    EngineCoreOutputs.trace = recorder.take() ──pipe──> MPCoreClient: live.apply(update)
                                                        dashboard: live.since(cursor), live.view

Nothing new crosses per step but one small record inside the message the core already sends
once a step (its outputs and stats). The block map costs more (a walk over every block), so
it is built only while a dashboard page is open: the server says so with one message through
the command pipe the requests take (``set_watched``), never per step. In-process (offline
``LLM``, --no-core-process) the recorder applies its records to its own ``LiveTrace`` and
nothing is taken.

``LiveTrace`` is written by the engine thread and read by the server's event loop, hence the
lock; readers get immutable snapshots (tuples, frozen views), never the ring itself.
"""

from __future__ import annotations

import collections
import secrets
import threading
from dataclasses import dataclass

from memwall.core.live_view import CoreView, ViewThrottle, build_view
from memwall.core.scheduler import Scheduler
from memwall.core.step_record import StepRecord

TRACE_CAPACITY = 512
"""Steps a LiveTrace keeps: the page's timeline and its batching/throughput figures use them."""


@dataclass(frozen=True)
class TraceUpdate:
    """What the core recorded since its previous EngineCoreOutputs (usually one step)."""

    steps: tuple[StepRecord, ...] = ()
    view: CoreView | None = None
    """A block map and queues built since, if one was due."""


class LiveTrace:
    """The recent steps (a bounded ring, oldest first) and the latest view."""

    def __init__(self, capacity: int = TRACE_CAPACITY) -> None:
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self._view: CoreView | None = None
        self._lock = threading.Lock()
        self.trace_id = secrets.token_hex(4)
        """Names this ring: a restarted engine has a new one, whose steps count from 0 again."""

    def apply(self, update: TraceUpdate) -> None:
        """Adds the update's steps (each once: an index already seen is skipped)."""
        with self._lock:
            last = self._steps[-1].index if self._steps else -1
            self._steps.extend(s for s in update.steps if s.index > last)
            if update.view is not None:
                self._view = update.view

    @property
    def view(self) -> CoreView | None:
        return self._view

    @property
    def last_index(self) -> int:
        """The newest step's index; -1 before the first."""
        steps = self._steps
        return steps[-1].index if steps else -1

    def steps(self) -> tuple[StepRecord, ...]:
        with self._lock:
            return tuple(self._steps)

    def since(self, index: int) -> tuple[StepRecord, ...]:
        """The kept steps after step ``index`` (-1: all of them), oldest first."""
        with self._lock:
            if not self._steps or self._steps[-1].index <= index:
                return ()
            return tuple(s for s in self._steps if s.index > index)


class TraceRecorder:
    """The engine core's side: numbers and keeps its steps, builds the view when due, and
    hands over what is new (``take``) for the next EngineCoreOutputs."""

    def __init__(self, view_interval_s: float = 0.25) -> None:
        self.live = LiveTrace()
        """This process's own copy (what an in-process dashboard reads)."""
        self.num_steps = 0
        self.watched = False
        """A dashboard page is open: build views (else none is built at all)."""
        self._throttle = ViewThrottle(view_interval_s)
        self._unsent: list[StepRecord] = []
        self._unsent_view: CoreView | None = None

    def record(self, step: StepRecord) -> None:
        self.num_steps = step.index + 1
        self._unsent.append(step)
        self.live.apply(TraceUpdate((step,)))

    def maybe_view(self, scheduler: Scheduler, force: bool = False) -> None:
        """Builds a view if one is watched and due (``force``: now, e.g. the engine just
        went idle)."""
        if self.watched and self._throttle.due(force):
            self._unsent_view = build_view(scheduler)
            self.live.apply(TraceUpdate(view=self._unsent_view))

    def take(self) -> TraceUpdate | None:
        if not self._unsent and self._unsent_view is None:
            return None
        update = TraceUpdate(tuple(self._unsent), self._unsent_view)
        self._unsent, self._unsent_view = [], None
        return update
