"""RayExecutor: one Ray actor per rank, on one host or many.

    engine core ──ray.put(sched), once──► object store ──► rank 0..N-1: .call("execute", ref)
                ◄── a Reply per actor (rank 0's carries the RunnerOutput) ──┘

The actors run the same rank code as the mp executor's processes (memwall/executor/rank.py:
``make_worker`` and ``call``). Pipeline stages hand their hidden states on as Ray objects: a
step calls every stage's actors at once, each later stage's call taking the ObjectRef of the
same tensor-parallel rank's answer in the stage before, so Ray moves the tensor between the two
actors (between hosts too) without the engine core touching it; an actor runs its calls in
order, so stage 0 computes the next step while the later stages finish this one. A placement group reserves one bundle of CPUs per rank, packed
onto one node by default (``MEMWALL_RAY_PLACEMENT=SPREAD`` or ``STRICT_SPREAD`` spreads
them). Ranks that all landed on this host share a memory segment for their all-reduce; ranks
on several nodes cannot, and use gloo over the network instead (``tp_comm`` auto).

A rank that dies, raises or hangs past ``comm_timeout_s`` fails the call with ``RankFailed``,
as in the mp executor: the shared segment is aborted so no rank waits forever, and the actors
and their placement group are removed. The ranks' own logs stay in Ray's session directory
(``/tmp/ray/session_latest/logs``); a failed call carries the rank's error and traceback.

Ray is joined as vLLM does: an already connected process keeps its connection; else a running
cluster (``RAY_ADDRESS``, or ``ray start`` on this host) is joined; else a local instance is
started, and stopped again with the last executor that uses it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
import weakref
from collections import deque

from memwall.config import CacheConfig, EngineArgs, SchedulerConfig, _ray_cluster_running
from memwall.core.step import RunnerOutput, SchedulerOutput
from memwall.executor.base import Executor, RankFailed
from memwall.executor.multiproc import START_TIMEOUT_S
from memwall.executor.rank import Reply, RankSpec, call, make_worker

logger = logging.getLogger("memwall")

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_started_users = 0
"""Executors using the local Ray instance this process started (stopped with the last one)."""


class RankActor:
    """One rank as a Ray actor (wrapped by ``ray.remote`` when the executor places it): the
    same Worker, and the same never-raising ``call``, as an mp rank's process."""

    def __init__(self) -> None:
        self.worker = None
        self.driver = False

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, a TCP port free on that IP): where this rank landed, and
        where rank 0 may open the gloo group's store."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ip, port

    def start(self, spec: RankSpec, ip: str) -> Reply:
        """Builds this rank's Worker and joins its group (gloo waits for every rank)."""
        logging.basicConfig(level=os.environ.get("MEMWALL_LOG_LEVEL", "WARNING"))
        self.driver = spec.rank == spec.world_size - spec.tp_size  # samples (as in rank.py)
        if spec.tp_comm == "gloo" and spec.tp_size > 1:
            _bind_gloo_to(ip)
        try:
            self.worker = make_worker(spec)
            return Reply(True, "ready")
        except BaseException as e:  # the executor decides what a failed rank means
            return Reply(False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")

    def call(self, method: str, *args, **kwargs) -> Reply:
        """``worker.method(*args, **kwargs)``. The arguments are top-level so that Ray hands
        an ObjectRef argument (the step's ``ray.put`` SchedulerOutput) in as its value."""
        return call(self.worker, method, args, kwargs, self.driver)


class RayExecutor(Executor):
    """``tensor_parallel_size`` rank actors behind the Executor calls (module docstring)."""

    def __init__(self, args: EngineArgs) -> None:
        ray = _import_ray()
        self.args = args
        parallel = args.parallel_config()
        self.world, self.tp = parallel.world_size, parallel.tensor_parallel_size
        self.pp = self.pipeline_depth = parallel.pipeline_parallel_size
        self.driver = self.world - self.tp  # tensor rank 0 of the last stage: it samples
        self._in_flight: deque[list] = deque()
        """The last stage's call refs of each submitted step, oldest first."""
        self.requested_comm = parallel.tp_comm
        self.timeout_s = parallel.comm_timeout_s
        self._actors: list = []
        self._groups: list = []  # the placement group (a list: the finalizer holds it, not self)
        self._segments: list = []
        self.nodes: list[str] = []
        """The Ray node id of each rank."""
        self.comm = ""
        self.failed: str | None = None
        """Why the group stopped working (a rank died, raised or hung); None while it works."""
        owns_ray = _connect(ray, self.world)
        # registered before any actor starts: a failed start cleans up like a shutdown
        self._finalizer = weakref.finalize(self, _stop, self._actors, self._groups,
                                           self._segments, owns_ray)
        try:
            self._start(ray)
        except BaseException:
            self.shutdown()  # no half-started group left holding CPUs or shared memory
            raise

    # ------------------------------------------------------------------ the group
    def _start(self, ray) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_rank = _cpus_per_rank(ray, self.args, self.world)
        group = _placement_group(ray, self.world, per_rank, self.timeout_s)
        self._groups.append(group)
        actor_class = ray.remote(RankActor)
        for rank in range(self.world):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            self._actors.append(actor_class.options(num_cpus=per_rank,
                                                    scheduling_strategy=strategy).remote())
        where = self._wait([a.where.remote() for a in self._actors], START_TIMEOUT_S)
        self.nodes = [node for node, _, _ in where]
        self.comm = self._choose_comm(ray.get_runtime_context().get_node_id())
        if self.comm == "shm" and self.tp > 1:  # one all-reduce segment per pipeline stage
            from memwall.distributed.shm_comm import ShmGroup
            self._segments.extend(ShmGroup.create(self.tp) for _ in range(self.pp))
        starts = [actor.start.remote(spec, ip) for actor, spec, (_, ip, _) in
                  zip(self._actors, self._specs(per_rank, where), where)]
        self._collect(starts, START_TIMEOUT_S)  # concurrently: gloo waits for every rank
        if self.pp > 1:
            self._call("use_handoff_pipe")

    def _specs(self, per_rank: int, where: list[tuple[str, str, int]]) -> list[RankSpec]:
        """Each stage's tensor-parallel group: its own all-reduce segment, or a gloo store
        opened by the stage's first rank."""
        specs = []
        for r in range(self.world):
            stage = r // self.tp
            _, ip, port = where[stage * self.tp]
            shm = self._segments[stage].name if self._segments else None
            gloo = f"{ip}:{port}" if self.comm == "gloo" else None
            # cpus None: Ray, not the rank, decides which cores a rank's CPUs are
            specs.append(RankSpec(self.args, rank=r, world_size=self.world, tp_size=self.tp,
                                  pp_size=self.pp, threads=per_rank, cpus=None,
                                  tp_comm=self.comm, shm_name=shm, gloo_address=gloo,
                                  timeout_s=self.timeout_s))
        return specs

    def _choose_comm(self, here: str) -> str:
        """shm when every rank is on this host (the segment is made here), else gloo."""
        on_this_host = all(node == here for node in self.nodes)
        if self.requested_comm == "auto":
            return "shm" if on_this_host else "gloo"
        if self.requested_comm == "shm" and not on_this_host and self.tp > 1:
            raise ValueError(f"tp_comm shm needs every rank on this host, but Ray placed them on "
                             f"{len(set(self.nodes))} node(s) ({self.nodes.count(here)} here): "
                             f"use --tp-comm gloo or auto, or MEMWALL_RAY_PLACEMENT=STRICT_PACK")
        return self.requested_comm

    def _wait(self, refs: list, timeout_s: float) -> list:
        """Every rank's return value, in rank order; RankFailed (and the group torn down) as
        soon as one rank's actor died, or when one did not answer within ``timeout_s``.
        (``ray.wait`` one at a time, not one ``ray.get`` of all: a dead rank must fail the call
        at once, while the live ones are still blocked in a collective waiting for it.)"""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: dict[int, object] = {}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                self._fail(f"rank {min(rank_of[r] for r in pending)} did not answer within "
                           f"{timeout_s:.0f} s (it hangs)")
            for ref in ready:
                try:
                    values[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    dead = isinstance(e, ray.exceptions.RayActorError)
                    self._fail(f"rank {rank_of[ref]} {'died' if dead else 'failed'} "
                               f"({_first_line(e)})", str(e))
        return [values[rank] for rank in range(len(refs))]

    def _collect(self, refs: list, timeout_s: float) -> list:
        """``_wait`` for Replies: their values; RankFailed when a rank's call raised."""
        replies = self._wait(refs, timeout_s)
        bad = [(rank, rep) for rank, rep in enumerate(replies) if not rep.ok]
        if bad:
            rank, rep = bad[0]
            self._fail(f"rank {rank} failed: {rep.error.splitlines()[0]}", rep.error)
        return [rep.value for rep in replies]

    def _fail(self, why: str, detail: str = "") -> None:
        self.failed = why
        logger.error("tensor-parallel group: %s%s", why, f"\n{detail}" if detail else "")
        for segment in self._segments:
            segment.abort()  # ranks waiting in a collective wake with an error
        self.shutdown()
        raise RankFailed(why)

    def _check(self) -> None:
        if self.failed is not None:
            raise RankFailed(f"the worker group is down ({self.failed})")

    def _call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        self._check()
        refs = [actor.call.remote(method, *args, **kwargs) for actor in self._actors]
        return self._collect(refs, timeout_s or self.timeout_s)

    # ------------------------------------------------------------------ Executor
    def load_model(self):
        return self._call("load_model", timeout_s=START_TIMEOUT_S)[0]

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig):
        plans = self._call("determine_num_blocks", cache, sched)
        return min(plans, key=lambda plan: plan.num_blocks)

    def init_cache(self, plan, max_num_seqs: int, max_model_len: int) -> None:
        self._call("init_cache", plan, max_num_seqs, max_model_len, timeout_s=START_TIMEOUT_S)

    def measure_step_shape(self, max_num_seqs: int, block_size: int):
        # every rank measures (its collectives need the others); the driver's figures decide
        return self._call("measure_step_shape", max_num_seqs, block_size,
                          timeout_s=START_TIMEOUT_S)[0]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        import ray
        self._check()  # (a Ray this executor started is gone with the group)
        if self.pp > 1:
            self.submit(sched)
            return self.collect()
        return self._call("execute", ray.put(sched))[0]  # serialized once for every actor

    def submit(self, sched: SchedulerOutput) -> None:
        """Starts a step on every stage without waiting (module docstring): stage s's rank r
        takes the ObjectRef of stage s-1's rank r's answer, its hidden states."""
        import ray
        if self.pp == 1:
            return super().submit(sched)
        self._check()
        ref = ray.put(sched)  # serialized once for every actor
        previous: list = [None] * self.tp
        for stage in range(self.pp):
            previous = [self._actors[stage * self.tp + r].call.remote("execute_stage", ref, previous[r])
                        for r in range(self.tp)]
        self._in_flight.append(previous)

    def collect(self) -> RunnerOutput:
        if self.pp == 1:
            return super().collect()
        # the last stage's answers; a failure anywhere before reaches them (execute_stage)
        return self._collect(self._in_flight.popleft(), self.timeout_s * self.pp)[0]

    def describe(self) -> str:
        """The layout (printed at start-up) and the driver's device half, as the mp executor's."""
        layouts = self._call("layout")
        comm = {"shm": "shared-memory all-reduce", "gloo": "gloo all-reduce"}[self.comm]
        head = (f"{self.world} ranks as Ray actors (ray executor) on {len(set(self.nodes))} "
                f"node(s): tensor parallel {self.tp}" + (f" ({comm})" if self.tp > 1 else "")
                + f" x pipeline parallel {self.pp}")
        ranks = "; ".join(f"rank {r}: {text}" for r, text in enumerate(layouts))
        return f"{head}; {ranks}; {self._call('describe')[self.driver]}"

    def shutdown(self) -> None:
        self._finalizer()


# ---------------------------------------------------------------------- helpers
def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend ray needs Ray: pip install 'ray>=2.40' "
                          "(or use --distributed-executor-backend mp on one host)") from e
    return ray


def _connect(ray, world: int) -> bool:
    """Joins Ray (see the module docstring); True when the instance is this process's own."""
    global _started_users
    if ray.is_initialized():
        if _started_users:
            _started_users += 1
        return _started_users > 0
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
    if _ray_cluster_running():
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError as e:
            raise RuntimeError(f"a Ray cluster is named (RAY_ADDRESS="
                               f"{os.environ.get('RAY_ADDRESS', '')!r}, or /tmp/ray/"
                               f"ray_current_cluster) but does not answer: {e}. Start it, run "
                               f"`ray stop` to forget it, or use --distributed-executor-backend "
                               f"mp") from e
        return False
    # as many CPUs as ranks at least: the mp executor also runs more ranks than cores
    ray.init(num_cpus=max(_local_cores(), world), include_dashboard=False, **quiet)
    _started_users = 1
    return True


def _cpus_per_rank(ray, args: EngineArgs, world: int) -> int:
    """CPUs a rank reserves (and its torch threads): ``--threads`` if given, else this host's
    cores split over the ranks, at most what the smallest node can give each of its ranks."""
    if args.threads:
        return args.threads
    smallest = min((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]),
                   default=0)
    return max(1, int(min(_local_cores(), smallest or _local_cores())) // world)


def _placement_group(ray, world: int, per_rank: int, timeout_s: float):
    """A ready placement group of ``world`` bundles of ``per_rank`` CPUs."""
    from ray.util.placement_group import placement_group, remove_placement_group

    strategy = os.environ.get("MEMWALL_RAY_PLACEMENT", "PACK").upper()
    if strategy not in PLACEMENTS:
        raise ValueError(f"MEMWALL_RAY_PLACEMENT={strategy!r}: use one of {', '.join(PLACEMENTS)}")
    total = ray.cluster_resources().get("CPU", 0)
    if total < world * per_rank:
        raise ValueError(f"the Ray cluster has {total:g} CPUs, and {world} ranks of {per_rank} "
                         f"CPU(s) need {world * per_rank}: add nodes, or give each rank fewer "
                         f"with --threads (at most {max(1, int(total) // world)})")
    group = placement_group([{"CPU": per_rank}] * world, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {world} ranks of {per_rank} CPU(s) "
                           f"({strategy}) within {timeout_s:.0f} s: other jobs hold the CPUs "
                           f"(see `ray status`), or no node fits a rank")
    return group


def _stop(actors: list, groups: list, segments: list, owns_ray: bool) -> None:
    """Kills the rank actors, removes their placement group, frees the shared memory, and
    stops Ray if this process started it and nothing else here uses it. (If this process dies
    first, Ray removes the actors and the group with their owner, the driver.)"""
    global _started_users
    import ray
    if ray.is_initialized():
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray is going down: nothing left to kill
                pass
        for group in groups:
            try:
                ray.util.remove_placement_group(group)
            except Exception:
                pass
        if owns_ray:
            _started_users -= 1
            if _started_users == 0:
                ray.shutdown()
    actors.clear()
    groups.clear()
    for segment in segments:
        segment.close()
        segment.unlink()
    segments.clear()


def _bind_gloo_to(ip: str) -> None:
    """Makes gloo use the interface that holds the node's IP. Unset, gloo binds to whatever
    the hostname resolves to, often 127.0.0.1, which ranks on other hosts cannot reach."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return  # the user's choice
    import fcntl
    import struct
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def _local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]
