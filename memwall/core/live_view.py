"""CoreView: the KV block map and the scheduler's queues at one moment, for the live dashboard.

Building it walks every block, so the engine core builds one at most every ``interval_s``
(``ViewThrottle``), and at once when it goes idle (so the page never keeps showing blocks that
were freed by the last step). It is compact: one character per block, and each request's block
table as a tuple of ids, never a Python object per block.

    states   "UUUSS..CCU....."      block 0..14
              U in use (one holder)  S shared (ref count > 1: a common prefix, or forks)
              C cached: free, but its contents are hashed and a prefix-cache hit can revive it
              . free
    tables   {"a": (0, 1, 2, 3, 4), "b": (3, 4, 9)}     blocks 3 and 4 are shared by a and b
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memwall.core.kv.block_pool import BlockPool
from memwall.core.scheduler import Scheduler
from memwall.request import Request

FREE, IN_USE, SHARED, CACHED = ".", "U", "S", "C"
MAX_QUEUE_ROWS = 256
"""Queue rows sent at most (a queue of thousands is summarized by its length)."""


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    status: str
    """RequestStatus value: running, waiting, preempted, swapped."""


@dataclass(frozen=True)
class CoreView:
    built: float
    """time.time() when it was built."""
    states: str
    """One character per KV block: FREE, IN_USE, SHARED or CACHED."""
    tables: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """request id -> the block ids it holds, in order."""
    running: tuple[QueuedRequest, ...] = ()
    waiting: tuple[QueuedRequest, ...] = ()
    """At most MAX_QUEUE_ROWS of each, in queue order; the counts are in EngineStats."""


# ref count (as a byte) -> state: 0 free, 1 in use, more shared
_BY_REF_COUNT = (FREE + IN_USE + SHARED * 254).encode()


def block_states(pool: BlockPool) -> str:
    """The state of every block of the pool, one character each.

    Written for big caches (it runs in the engine's step): bytes() and translate() walk the ref
    counts in C, and only the hashed blocks are visited one by one (18 ms -> ~2 ms for 128k
    blocks, benchmarks/dashboard.py)."""
    refs = pool.ref_counts
    try:
        raw = bytes(refs)
    except ValueError:  # a block shared by more than 255 sequences does not fit a byte
        raw = bytes(min(r, 2) for r in refs)
    states = bytearray(raw.translate(_BY_REF_COUNT))
    cached = ord(CACHED)
    for block in pool.cached.values():
        if not refs[block]:
            states[block] = cached
    return states.decode("ascii")


def build_view(scheduler: Scheduler) -> CoreView:
    kv = scheduler.kv
    tables = {rid: tuple(blocks) for rid, blocks in kv.block_tables.items()}
    return CoreView(time.time(), block_states(kv.pool), tables,
                    _rows(scheduler.running), _rows(scheduler.waiting))


def _rows(requests) -> tuple[QueuedRequest, ...]:
    rows = []
    for request in requests:
        if len(rows) == MAX_QUEUE_ROWS:
            break
        rows.append(_row(request))
    return tuple(rows)


def _row(request: Request) -> QueuedRequest:
    return QueuedRequest(request.request_id, request.num_computed_tokens,
                         request.num_prompt_tokens, request.num_output_tokens,
                         request.status.value)


class ViewThrottle:
    """Builds a view when ``interval_s`` has passed since the last one (or when forced)."""

    def __init__(self, interval_s: float = 0.25, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -float("inf")

    def due(self, force: bool = False) -> bool:
        now = self._clock()
        if not force and now - self._last < self.interval_s:
            return False
        self._last = now
        return True
