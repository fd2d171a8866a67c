"""DPCoreClient: data parallel, N whole engine replicas behind one API process
(``--data-parallel-size N``). It is the ``CoreClient`` of memwall/engine/llm_engine.py over N
MPCoreClients (memwall/engine/core_client.py), one core process each:

    LLMEngine ── add_request ──> DPRouter (prefix affinity, load) ──> replica r (MPCoreClient)
              ── abort ───────> the replica the request went to
              <── step() ─────── every replica's news since the last call, merged

Each replica has its own KV cache (and prefix cache) and its share of the host: 1/N of the
cores this process may use (pinned to them; its threads default to their number) and 1/N of the
KV budget (--kv-cache-memory or --kv-cache-fraction; on cuda --gpu-memory-utilization too). An
exact --num-kv-blocks stays per replica. The replicas load in parallel. On cuda they share the
one GPU, and each counts the others' memory as "non-torch" while it profiles: give
--kv-cache-memory there rather than rely on the profile.

Failure: the replicas live and die together. When any core process dies, ``on_death`` fires
and ``step()`` raises EngineCoreDeadError; the owner then shuts the client down (every replica,
the live ones too) and builds a new one, as AsyncLLMEngine's restart does. Requests on the live
replicas are lost with the dead one's: simple, and the server's restart path stays the one it
has for a single core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

from memwall.config import EngineArgs
from memwall.engine.core_client import POLL_S, EngineCoreStartError, MPCoreClient
from memwall.engine.dp_router import DPRouter
from memwall.engine.protocol import (AdapterCounters, EngineCoreOutputs, EngineCoreRequest,
                                     EngineStats, LoRAStatsSnapshot)

logger = logging.getLogger("memwall")


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    args: EngineArgs
    """The replica's engine arguments: data_parallel_size 1, its threads and KV share."""
    cpus: tuple[int, ...] | None
    """Cores its process is pinned to (None: fewer cores than replicas, no pinning)."""


def plan_replicas(args: EngineArgs, cpus: list[int]) -> list[ReplicaPlan]:
    """Splits the host among ``args.data_parallel_size`` replicas: consecutive slices of ``cpus``
    (what is left over after an even split goes unused), threads = the slice's size (split
    again among a replica's tensor/pipeline ranks) unless --threads was given, and 1/N of the
    KV memory budget each."""
    n = args.data_parallel_size
    per = max(1, len(cpus) // n)
    ranks = args.parallel_config().world_size
    share: dict = dict(data_parallel_size=1, threads=args.threads or max(1, per // ranks),
                       gpu_memory_utilization=args.gpu_memory_utilization / n)
    if args.kv_cache_memory is not None:
        share["kv_cache_memory"] = max(1, args.kv_cache_memory // n)
    else:
        share["kv_cache_fraction"] = args.kv_cache_fraction / n
    replica = dataclasses.replace(args, **share)
    pin = len(cpus) >= n
    return [ReplicaPlan(replica, tuple(cpus[i * per:(i + 1) * per]) if pin else None)
            for i in range(n)]


class DPCoreClient:
    def __init__(self, args: EngineArgs,
                 start: Callable[[EngineArgs, tuple[int, ...] | None], MPCoreClient] = MPCoreClient
                 ) -> None:
        """Starts ``args.data_parallel_size`` core processes at once and waits for all of them.
        Raises EngineCoreStartError (naming the replica) when one cannot start; the others are
        stopped then. ``start``: builds one replica's client (tests substitute it)."""
        plans = plan_replicas(args, sorted(os.sched_getaffinity(0)))
        if plans[0].cpus is not None and plans[0].args.threads > len(plans[0].cpus):
            logger.warning("--threads %d is more than the %d core(s) each of the %d replicas is "
                           "pinned to: its threads will take turns on them (leave --threads out "
                           "to use one per core)", args.threads, len(plans[0].cpus), len(plans))
        self.replicas: list[MPCoreClient] = _start_all(plans, start)
        self.on_death: Callable[[], None] | None = None
        """Called from a reader thread when any replica's core process is gone."""
        self._news = threading.Event()  # set by the replicas' reader threads as news arrives
        self._closed = False
        for index, replica in enumerate(self.replicas):
            replica.on_news = self._news.set
            replica.on_death = lambda index=index: self._replica_died(index)
        first = self.replicas[0]
        n = len(self.replicas)
        # the router remembers no more blocks than a replica's KV cache can keep
        self.router = DPRouter(n, args.block_size,
                               max_blocks=max(1, first.stats().num_total_blocks))
        self.info = dataclasses.replace(first.info, description=(
            f"data parallel {n}: {n} engine replicas ({_cores(plans)}), each: "
            f"{first.info.description}"))

    @property
    def live(self):
        """Replica 0's recent steps and block map (the live dashboard shows that replica's;
        its counters, from ``stats``, are all replicas')."""
        return self.replicas[0].live

    @property
    def processes(self) -> list:
        """The replicas' core processes, in replica order."""
        return [replica.process for replica in self.replicas]

    # ---- CoreClient ------------------------------------------------------------------------
    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None:
        """Sends the request (all its samples) to the replica the router picks."""
        ids = [first.request_id, *(f.request_id for f in forks)]
        index = self.router.route(ids, first.prompt_token_ids, _namespace(first))
        self.replicas[index].add_request(first, forks)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each id to the replica running it; ids no longer in flight need no abort."""
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.router.finish(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort_requests(ids)

    def remove_lora(self, lora_int_id: int) -> None:
        for replica in self.replicas:
            replica.remove_lora(lora_int_id)

    def set_watched(self, watched: bool) -> None:
        self.replicas[0].set_watched(watched)  # the replica whose block map the page shows

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def step(self) -> EngineCoreOutputs:
        """Every replica's news since the last call, merged; waits up to POLL_S for some when
        there is none. Raises EngineCoreDeadError once any replica's core process is gone."""
        self._news.clear()  # news from here on sets it: none is slept through
        merged = self._collect()
        if not merged.outputs:
            self._news.wait(POLL_S)
            merged = self._collect()
        return merged

    def stats(self) -> EngineStats:
        """All replicas' latest stats, summed (merge_stats)."""
        return merge_stats([replica.stats() for replica in self.replicas])

    def shutdown(self) -> None:
        """Stops every replica (in parallel: each finishes its step, then exits)."""
        if self._closed:
            return
        self._closed = True
        logger.info("data parallel routing: %s", self.router.stats())
        _each(lambda replica: replica.shutdown(), self.replicas)

    # ---- internals -------------------------------------------------------------------------
    def _collect(self) -> EngineCoreOutputs:
        outputs = []
        for replica in self.replicas:
            outputs.extend(replica.step(timeout=0).outputs)
        for output in outputs:
            if output.finished:
                self.router.finish(output.request_id)
        return EngineCoreOutputs(outputs, self.stats())

    def _replica_died(self, index: int) -> None:
        logger.error("data parallel replica %d died; the other %d replica(s) go with it",
                     index, len(self.replicas) - 1)
        if self.on_death is not None:
            self.on_death()


def _namespace(request: EngineCoreRequest) -> tuple:
    """The request's prefix-cache namespace, as far as the API side knows it: its extra keys
    and its adapter (the core adds the adapter's content hash; the name stands in for it)."""
    if request.lora_request is None:
        return request.cache_extra_keys
    return request.cache_extra_keys + (("lora", request.lora_request.lora_name),)


def _start_all(plans: list[ReplicaPlan], start) -> list[MPCoreClient]:
    """One client per plan, started side by side (a load takes seconds: N of them should not
    take N times as long). The first failure is raised, the replicas that did start stopped."""
    clients: list = [None] * len(plans)
    errors: list[BaseException | None] = [None] * len(plans)

    def one(index: int) -> None:
        try:
            clients[index] = start(plans[index].args, plans[index].cpus)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors[index] = e

    _each(one, range(len(plans)))
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if not failed:
        return clients
    for client in clients:
        if client is not None:
            client.shutdown(timeout=1.0)
    index, error = failed[0]
    if isinstance(error, EngineCoreStartError):
        raise EngineCoreStartError(f"data parallel replica {index}: {error}") from None
    raise error


def _each(fn, items) -> None:
    """``fn(item)`` for every item, each in a thread of its own; returns when all are done."""
    threads = [threading.Thread(target=fn, args=(item,), name="memwall-dp") for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _cores(plans: list[ReplicaPlan]) -> str:
    if plans[0].cpus is None:
        return f"{plans[0].args.threads} thread(s) each, not pinned"
    return "cores " + " | ".join(_span(p.cpus) for p in plans)


def _span(cpus: tuple[int, ...]) -> str:
    contiguous = cpus == tuple(range(cpus[0], cpus[0] + len(cpus)))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous and len(cpus) > 1 else ",".join(map(str, cpus))


# ---- stats ----------------------------------------------------------------------------------
def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's. Every field but ``lora`` is a gauge of requests or
    blocks (running, waiting, free, total) or a counter since start (preemptions, prefix-cache
    tokens, evictions, drafts): both add up across replicas. The rates (hit rate, KV usage,
    acceptance) are properties, so they come out as ratios of the sums, not means of ratios."""
    summed = {f.name: sum(getattr(s, f.name) for s in stats)
              for f in dataclasses.fields(EngineStats) if f.name != "lora"}
    loras = [s.lora for s in stats if s.lora is not None]
    return EngineStats(**summed, lora=merge_lora_stats(loras) if loras else None)


def merge_lora_stats(snapshots: list[LoRAStatsSnapshot]) -> LoRAStatsSnapshot:
    """Sums the replicas' LoRA counters; per adapter by name. ``resident`` counts an adapter
    once per replica holding it (each replica has its own host cache)."""
    summed = {f.name: sum(getattr(s, f.name) for s in snapshots)
              for f in dataclasses.fields(LoRAStatsSnapshot) if f.name != "adapters"}
    adapters: dict[str, AdapterCounters] = {}
    for snapshot in snapshots:
        for a in snapshot.adapters:
            seen = adapters.get(a.name)
            adapters[a.name] = a if seen is None else AdapterCounters(
                a.name, seen.requests + a.requests, seen.loads + a.loads,
                seen.prefix_queries + a.prefix_queries, seen.prefix_hits + a.prefix_hits)
    return LoRAStatsSnapshot(**summed, adapters=tuple(adapters.values()))


__all__ = ["DPCoreClient", "ReplicaPlan", "plan_replicas", "merge_stats", "merge_lora_stats"]
