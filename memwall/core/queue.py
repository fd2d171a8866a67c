"""Waiting queues: FCFS (default) or by priority, with preempted requests put back in front.

FCFS: arrival order; a preempted request goes back to the very front.
Priority: lower ``priority`` first, then arrival; a preempted request simply re-enters at its
place, which is in front of every later arrival of its priority.
"""

from __future__ import annotations

import bisect
from collections import deque

from memwall.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float]:
    return (request.sampling_params.priority, request.arrival_time)


class FCFSQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)

    def add_front(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, request: Request) -> bool:
        return request in self._items


class PriorityQueue(FCFSQueue):
    """Kept sorted by priority_key; insertion is a bisect (queues here are small)."""

    def __init__(self) -> None:
        self._items: list[Request] = []  # type: ignore[assignment]

    def add(self, request: Request) -> None:
        keys = [priority_key(r) for r in self._items]
        self._items.insert(bisect.bisect_right(keys, priority_key(request)), request)

    add_front = add

    def pop(self) -> Request:
        return self._items.pop(0)


def make_queue(policy: str) -> FCFSQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
