"""A communicator whose ranks are threads of one process: the sharding arithmetic tested in
milliseconds, without processes or shared memory (tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import threading

import torch

from memwall.distributed.communicator import Communicator


class ThreadGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = 0

    def comms(self) -> list["ThreadComm"]:
        return [ThreadComm(self, r) for r in range(self.size)]


class ThreadComm(Communicator):
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.group.slots[self.rank] = t.clone()
        self.group.barrier.wait()
        parts = list(self.group.slots)
        if self.rank == 0:
            self.group.calls += 1
        self.group.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # rank order, as the shared-memory sum adds
        return total

    def all_gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        parts = self._exchange(t)
        assert [p.shape[-1] for p in parts] == sizes
        return torch.cat(parts, dim=-1)


def run_ranks(size: int, fn) -> list:
    """fn(comm) on ``size`` threads at once; their results in rank order (re-raises)."""
    group = ThreadGroup(size)
    results: list = [None] * size
    errors: list = []

    def body(comm: ThreadComm) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(c,)) for c in group.comms()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
