"""MultiprocExecutor: one worker process per rank on this host.

    engine core ──put(("execute", sched))──► shared-memory ring (pickled once) ──► rank 0..N-1
                ◄── Reply per rank (a pipe each; rank 0's carries the RunnerOutput) ──┘

Each rank is pinned to its share of this process's CPUs (1 core a rank on a 2-core box) and
joins its tensor-parallel group (memwall/distributed: a shared-memory all-reduce, or gloo).
A rank that dies, raises or hangs past ``comm_timeout_s`` fails the call with ``RankFailed``:
the other ranks' collectives are aborted so none waits forever, and the group is torn down
(the engine core ends the in-flight requests; ``restart()`` builds a fresh group).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
import weakref
from multiprocessing.connection import wait

from memwall.config import CacheConfig, EngineArgs, SchedulerConfig
from memwall.core.step import RunnerOutput, SchedulerOutput
from memwall.executor.base import Executor, RankFailed
from memwall.executor.rank import SHUTDOWN, Reply, RankSpec, run_rank

logger = logging.getLogger("memwall")

START_TIMEOUT_S = 600.0  # loading a large model may take minutes; a rank that dies fails at once


class MultiprocExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.parallel = parallel = args.parallel_config()
        self.world, self.tp = parallel.world_size, parallel.tensor_parallel_size
        self.pp = self.pipeline_depth = parallel.pipeline_parallel_size
        self.driver = self.world - self.tp  # tensor rank 0 of the last stage: it samples
        self.comm = parallel.tp_comm if parallel.tp_comm != "auto" else "shm"
        self.timeout_s = parallel.comm_timeout_s
        self._procs: list = []
        self._conns: list = []
        self._segments: list = []
        self._inbox = None
        self.failed: str | None = None
        """Why the group stopped working (a rank died, raised or hung); None while it works."""
        from memwall.distributed.shm_broadcast import ShmBroadcast
        from memwall.distributed.shm_comm import ShmGroup

        if self.comm == "shm" and self.tp > 1:  # one all-reduce segment per pipeline stage
            self._segments.extend(ShmGroup.create(self.tp) for _ in range(self.pp))
        self._inbox = ShmBroadcast(self.world)
        # registered before any process starts: a failed start cleans up like a shutdown
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inbox,
                                           self._segments)
        self._start()

    # ------------------------------------------------------------------ the group
    def _specs(self) -> list[RankSpec]:
        cpus = sorted(os.sched_getaffinity(0))
        per = max(1, len(cpus) // self.world)
        pin = len(cpus) >= self.world
        threads = self.args.threads or per
        gloo = ([f"127.0.0.1:{_free_port()}" for _ in range(self.pp)]
                if self.comm == "gloo" and self.tp > 1 else [None] * self.pp)
        shm = [s.name for s in self._segments] or [None] * self.pp
        return [RankSpec(self.args, r, self.world, self.tp, self.pp, threads,
                         tuple(cpus[r * per:(r + 1) * per]) if pin else None, self.comm,
                         shm[r // self.tp], gloo[r // self.tp], self.timeout_s)
                for r in range(self.world)]

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with OpenMP threads
        for spec in self._specs():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=run_rank, args=(spec, self._inbox.handle(), child),
                               name=f"memwall-rank-{spec.rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(START_TIMEOUT_S)
        if self.pp > 1:  # each stage's ranks send to the next stage's through a ring of theirs
            self._call("connect_pipe_in", self._call("open_pipe_out"))

    def _collect(self, timeout_s: float) -> list:
        """Every rank's reply to the last call, in rank order; RankFailed (and the group torn
        down) when a rank died, raised, or did not answer within ``timeout_s``."""
        replies: dict[int, Reply] = {}
        deadline = time.monotonic() + timeout_s
        waiting = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while waiting:
            left = deadline - time.monotonic()
            ready = wait([*waiting, *sentinels], timeout=max(0.0, left))
            if not ready:
                self._fail(f"rank {min(waiting.values())} did not answer within {timeout_s:.0f} s "
                           f"(it hangs)")
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        replies[rank] = obj.recv()
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                elif sentinels.get(obj) in waiting.values():
                    rank = sentinels[obj]
                    self._procs[rank].join(0.1)
                    self._fail(f"rank {rank} died (exit code {self._procs[rank].exitcode})")
        bad = [(r, rep) for r, rep in sorted(replies.items()) if not rep.ok]
        if bad:
            rank, rep = bad[0]
            self._fail(f"rank {rank} failed: {rep.error.splitlines()[0]}", rep.error)
        return [replies[r].value for r in range(self.world)]

    def _fail(self, why: str, detail: str = "") -> None:
        self.failed = why
        logger.error("tensor-parallel group: %s%s", why, f"\n{detail}" if detail else "")
        for segment in self._segments:
            segment.abort()  # ranks waiting in a collective wake with an error
        self.shutdown()
        raise RankFailed(why)

    def _call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        if self.failed is not None:
            raise RankFailed(f"the worker group is down ({self.failed})")
        self._inbox.put((method, args, kwargs))
        return self._collect(timeout_s or self.timeout_s)

    # ------------------------------------------------------------------ Executor
    def load_model(self):
        return self._call("load_model", timeout_s=START_TIMEOUT_S)[0]

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig):
        plans = self._call("determine_num_blocks", cache, sched)
        return min(plans, key=lambda plan: plan.num_blocks)

    def init_cache(self, plan, max_num_seqs: int, max_model_len: int) -> None:
        self._call("init_cache", plan, max_num_seqs, max_model_len, timeout_s=START_TIMEOUT_S)

    def measure_step_shape(self, max_num_seqs: int, block_size: int):
        # every rank measures (its share of the layers and the gathered head run collectives);
        # the driver's figures decide
        return self._call("measure_step_shape", max_num_seqs, block_size,
                          timeout_s=START_TIMEOUT_S)[0]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self._call("execute", sched)[self.driver]

    def submit(self, sched: SchedulerOutput) -> None:
        """Broadcasts a step without waiting: with pipeline stages, stage 0 starts the next
        step while the later stages finish this one."""
        if self.failed is not None:
            raise RankFailed(f"the worker group is down ({self.failed})")
        self._inbox.put(("execute", (sched,), {}))

    def collect(self) -> RunnerOutput:
        return self._collect(self.timeout_s)[self.driver]  # every rank answers in order

    def describe(self) -> str:
        """The layout (printed at start-up) and the driver's device half."""
        layouts = self._call("layout")
        comm = {"shm": "shared-memory all-reduce", "gloo": "gloo all-reduce"}[self.comm]
        head = (f"{self.world} ranks in processes (mp executor): tensor parallel {self.tp}"
                + (f" ({comm})" if self.tp > 1 else "") + f" x pipeline parallel {self.pp}")
        ranks = "; ".join(f"rank {r}: {text}" for r, text in enumerate(layouts))
        return f"{head}; {ranks}; {self._call('describe')[self.driver]}"

    def shutdown(self) -> None:
        self._finalizer()

    def check_health(self) -> None:
        """RankFailed when the group is down or a rank has died since the last call."""
        if self.failed is None:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self.failed = f"rank {dead[0]} died (exit code {self._procs[dead[0]].exitcode})"
        if self.failed is not None:
            raise RankFailed(self.failed)


def _stop(procs: list, inbox, segments: list) -> None:
    """Asks every rank to exit, then kills what is left; frees the shared memory."""
    if inbox is not None:
        try:
            if any(p.is_alive() for p in procs):
                inbox.put((SHUTDOWN, (), {}), timeout=1.0)
        except (TimeoutError, OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)
    if inbox is not None:
        inbox.close()
    for segment in segments:
        segment.close()
        segment.unlink()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
