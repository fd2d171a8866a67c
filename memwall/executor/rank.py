"""One rank's process (or Ray actor): its communicator, its Worker, and the loop that runs
whatever the executor broadcasts.

    executor                         rank r (this file)
    broadcast.put((method, args))    msg = broadcast.get()
                                     result = getattr(worker, method)(*args)
    replies[r].recv()            <-  conn.send(Reply(ok, result, error))

Every rank runs every call; only the driver's result of ``execute`` (tensor rank 0 of the last
pipeline stage: the one that samples) is sent back, the others send an empty acknowledgement,
so the executor learns of a failure on any rank.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from memwall.config import EngineArgs

logger = logging.getLogger("memwall")

SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class RankSpec:
    """What a rank's process needs to join its group (picklable: it crosses ``spawn``)."""

    args: EngineArgs
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    threads: int
    cpus: tuple[int, ...] | None
    """CPUs to pin this rank to (one rank per core keeps the spinning collectives off each
    other's cores); None: no pinning."""
    tp_comm: str
    """shm or gloo."""
    shm_name: str | None = None
    """The stage's tensor-parallel shared-memory segment (tp_comm shm)."""
    gloo_address: str | None = None
    """host:port of the torch.distributed store (tp_comm gloo)."""
    timeout_s: float = 120.0

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        """The pipeline stage: ranks are numbered stage by stage (rank = stage * tp + tp_rank)."""
        return self.rank // self.tp_size


@dataclass(frozen=True)
class Reply:
    ok: bool
    value: Any = None
    error: str = ""
    """The rank's exception, one line, then its traceback."""


def make_communicator(spec: RankSpec):
    """The rank's tensor-parallel communicator, or None for one rank a stage."""
    if spec.tp_size == 1:
        return None
    if spec.tp_comm == "shm":
        from memwall.distributed.communicator import ShmCommunicator
        from memwall.distributed.shm_comm import ShmGroup
        return ShmCommunicator(ShmGroup.attach(spec.shm_name, spec.tp_rank, spec.tp_size,
                                               timeout_s=spec.timeout_s))
    from memwall.distributed.communicator import GlooCommunicator
    return GlooCommunicator.init(spec.gloo_address, spec.tp_rank, spec.tp_size, spec.timeout_s)


def make_worker(spec: RankSpec):
    """This rank's Worker, its process pinned and its threads set first."""
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    import dataclasses
    from memwall.worker.worker import Worker
    args = dataclasses.replace(spec.args, threads=spec.threads)
    return Worker(args, tp_comm=make_communicator(spec), stage=(spec.stage, spec.pp_size))


def call(worker, method: str, args: tuple, kwargs: dict, driver: bool) -> Reply:
    """Runs one broadcast call on this rank's worker; never raises."""
    try:
        value = getattr(worker, method)(*args, **kwargs)
        if method == "execute" and not driver:
            value = None  # the driver's answer is the step's; the others only acknowledge
        return Reply(True, value)
    except BaseException as e:  # the executor decides what a failed rank means
        return Reply(False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _die_with_parent() -> None:
    """A rank must not outlive its executor's process, however that ends (Ctrl-C, kill -9):
    Linux kills it when the parent dies; the loop below also checks, where prctl is missing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the executor's to handle
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _next_call(inbox, parent: int):
    """The next broadcast call; SHUTDOWN when the parent process is gone."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except TimeoutError:
            if os.getppid() != parent:
                return SHUTDOWN, (), {}


def run_rank(spec: RankSpec, broadcast_handle, conn) -> None:
    """A rank process's main: build the worker, then serve calls until SHUTDOWN."""
    from memwall.distributed.shm_broadcast import ShmBroadcast

    parent = os.getppid()
    _die_with_parent()
    logging.basicConfig(level=os.environ.get("MEMWALL_LOG_LEVEL", "WARNING"))
    inbox = ShmBroadcast.attach(broadcast_handle, spec.rank)
    try:
        worker = make_worker(spec)
    except BaseException as e:
        conn.send(Reply(False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(Reply(True, "ready"))
    try:
        while True:
            method, args, kwargs = _next_call(inbox, parent)
            if method == SHUTDOWN:
                break
            driver = spec.rank == spec.world_size - spec.tp_size  # samples: last stage, tp rank 0
            conn.send(call(worker, method, args, kwargs, driver))
    except (EOFError, BrokenPipeError):
        pass  # the executor is gone: nothing to answer
    finally:
        comm = getattr(worker, "tp_comm", None)
        if comm is not None:
            comm.close()
        if getattr(worker, "pipe", None) is not None:
            worker.pipe.close()
        inbox.close()
