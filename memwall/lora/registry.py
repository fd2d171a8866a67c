"""LoRARegistry: the engine core's view of the adapters (pure Python, no tensors).

It decides what the workers' host caches hold: an adapter asked for the first time is loaded on
the workers on a thread of its own (the step loop never waits for a disk), and while the caches
are full the least valuable adapter no live request uses is dropped. It also names the prefix
cache namespace of each request: the adapter's content hash (a reload with new weights under
the same name never meets the old KV), or, with ``cache_policy="vllm"``, its name (vLLM's
behaviour, kept for comparison: it serves stale KV after such a reload).

    add_request(lora=r) -> submit(r) -> PendingAdapter (thread: executor.add_lora(r))
                           ready -> info (content hash, rank) -> cache_key(r) -> scheduler

With the adapter-aware policy adapters and KV blocks share one pool (``attach_pool``, S-LoRA's
unified paging with FastLibra's cost model): a loaded adapter is parked in KV blocks of its own
(at most half the pool), and when blocks run short the pool drops whichever is worth less per
block, an idle adapter (request rate x load time / blocks) or a cached KV block (decayed use
count x the time to prefill it again), before anyone is preempted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from memwall.engine.protocol import AdapterCounters, LoRAStatsSnapshot
from memwall.lora.request import LoRARequest

@dataclass
class AdapterStats:
    """Per adapter, for metrics (its prefix-cache counts come from the KV manager's)."""

    loads: int = 0
    requests: int = 0


@dataclass
class LoRAStats:
    loads: int = 0
    """Adapters read from disk into the host caches."""
    evictions: int = 0
    """Adapters dropped from the host caches to make room."""
    per_adapter: dict[str, AdapterStats] = field(default_factory=dict)


PARKED_SHARE = 0.5
"""Most of the KV pool that parked adapters may hold (more stay in host memory)."""


class PendingAdapter:
    """An adapter on its way to the workers: queued (the host caches are full of adapters that
    live requests use), then loading on the registry's thread; ``ready`` once loaded or failed."""

    def __init__(self, lora: LoRARequest, future: Future | None = None) -> None:
        self.lora, self.future = lora, future

    @property
    def ready(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self, timeout: float) -> None:
        if self.future is None:
            time.sleep(timeout)
            return
        try:
            self.future.exception(timeout=timeout)
        except TimeoutError:
            pass


class LoRARegistry:
    def __init__(self, add: Callable, remove: Callable, max_cpu_loras: int,
                 cache_policy: str = "adapter-aware") -> None:
        """``add(LoRARequest) -> AdapterInfo`` and ``remove(lora_int_id)`` act on the workers."""
        if cache_policy not in ("adapter-aware", "vllm"):
            raise ValueError(f"lora cache policy {cache_policy!r}: use adapter-aware or vllm")
        self._add, self._remove = add, remove
        self.max_cpu_loras = max_cpu_loras
        self.cache_policy = cache_policy
        self.loaded: OrderedDict[int, object] = OrderedDict()
        """lora id -> AdapterInfo, in the host caches; least recently used first."""
        self.requests: dict[int, LoRARequest] = {}
        self._pending: dict[int, PendingAdapter] = {}
        """Queued or loading, by lora id (every request for it shares one load)."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="memwall-lora")
        self.stats = LoRAStats()
        self.rate: dict[int, float] = {}
        """Decayed request count per adapter id (how likely its KV and weights are reused)."""
        self._rate_time = time.monotonic()
        self.owner_of: dict[tuple, int] = {(): 0}
        """prefix-cache namespace -> lora id (0: the base model)."""
        self.unloaded: set[int] = set()
        """Adapters the API side unloaded: their cached KV can never be used again."""
        # The unified pool (attach_pool): loaded adapters hold KV blocks of the engine's pool.
        self.pool = None
        self._park: Callable | None = None
        self._in_use: Callable[[], set[int]] = set
        self.blocks_of: dict[int, list[int]] = {}
        """lora id -> the KV blocks its weights are parked in."""

    def attach_pool(self, pool, park: Callable, in_use: Callable[[], set[int]]) -> None:
        """Adapters and KV blocks share ``pool`` (a BlockPool): a loaded adapter is parked in
        blocks of its own (``park(lora_id, block_ids)`` on the workers), and the pool drops an
        idle adapter instead of a cached KV block when the adapter is worth less per block:
        its request rate x its load time / its blocks, against the block's use count x the
        pool's ``block_cost_s`` (the seconds to prefill one block again)."""
        self.pool, self._park, self._in_use = pool, park, in_use
        pool.reclaim = self.reclaim

    # ---- loading ---------------------------------------------------------------------------
    def submit(self, lora: LoRARequest, in_use: set[int]) -> PendingAdapter:
        """The adapter's way to the workers (shared by every request that asks meanwhile).
        ``in_use``: adapters live requests hold, which are never dropped to make room."""
        self.observe(lora.lora_int_id)
        self.requests[lora.lora_int_id] = lora
        self._stats(lora).requests += 1
        if lora.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora.lora_int_id)
            future: Future = Future()
            future.set_result(self.loaded[lora.lora_int_id])
            return PendingAdapter(lora, future)
        pending = self._pending.get(lora.lora_int_id)
        if pending is None:
            pending = self._pending[lora.lora_int_id] = PendingAdapter(lora)
            self.pump(in_use | {lora.lora_int_id})
        return pending

    def pump(self, in_use: set[int]) -> None:
        """Starts queued loads while the host caches have room, or an adapter no live request
        uses can be dropped for one (the least valuable, or least recently used under vllm)."""
        for pending in [p for p in self._pending.values() if p.ready]:
            try:  # finished loads join the cache now (their requests may have been aborted)
                self.take(pending)
            except Exception:  # noqa: BLE001 - a waiting request still reads the error itself
                self._pending.pop(pending.lora.lora_int_id, None)
        for lora_int_id, info in self.loaded.items():  # parked later, once the pool can spare
            if self.pool is not None and lora_int_id not in self.blocks_of:
                self._try_park(lora_int_id, info)
                break
        for pending in [p for p in self._pending.values() if p.future is None]:
            if pending.lora.lora_int_id not in in_use:  # every request for it was aborted
                del self._pending[pending.lora.lora_int_id]
                continue
            loading = sum(1 for p in self._pending.values() if p.future is not None)
            if len(self.loaded) + loading >= self.max_cpu_loras and not self._evict_one(in_use):
                return
            pending.future = self._thread.submit(self._add, pending.lora)

    def take(self, pending: PendingAdapter):
        """The loaded adapter's info (raises the load's error); may be called again."""
        lora = pending.lora
        if self._pending.get(lora.lora_int_id) is pending:
            del self._pending[lora.lora_int_id]
        info = pending.future.result()
        if lora.lora_int_id not in self.loaded:
            self.loaded[lora.lora_int_id] = info
            self.stats.loads += 1
            self._stats(lora).loads += 1
        self._try_park(lora.lora_int_id, info)
        return info

    def _try_park(self, lora_int_id: int, info) -> None:
        """Gives a loaded adapter its KV blocks (evicting what the pool values least); while
        the pool cannot spare them it stays in host memory and is parked later (pump)."""
        if self.pool is None or not info.park_blocks or lora_int_id in self.blocks_of:
            return
        n = info.park_blocks
        parked = sum(len(b) for b in self.blocks_of.values())
        if parked + n > self.pool.num_blocks * PARKED_SHARE:
            return  # sequences keep most of the pool: adapters in use can never starve them
        while self.pool.num_free_blocks < n and self.reclaim(None, keep={lora_int_id}):
            pass
        if self.pool.num_free_blocks < n:
            return
        blocks = self.pool.allocate(n)
        self.blocks_of[lora_int_id] = blocks
        self._park(lora_int_id, blocks)

    def reclaim(self, kv_keep_value: float | None, keep: set[int] = frozenset()) -> bool:
        """Drops the parked adapter no live request uses that is worth least per block, if it
        is worth less than ``kv_keep_value`` (None: any); True if one was dropped."""
        in_use = self._in_use() | set(keep)
        idle = [i for i in self.blocks_of if i not in in_use]
        if not idle:
            return False
        value = {i: self.rate_of(i) * self.loaded[i].load_s / len(self.blocks_of[i])
                 for i in idle}
        victim = min(idle, key=value.__getitem__)
        if kv_keep_value is not None and value[victim] >= kv_keep_value:
            return False
        self.unload(victim)
        self.stats.evictions += 1
        return True

    def _evict_one(self, keep: set[int]) -> bool:
        candidates = [i for i in self.loaded if i not in keep]
        if not candidates:
            return False
        if self.cache_policy == "vllm":
            victim = candidates[0]  # least recently used
        else:  # the one least likely to be asked for again
            victim = min(candidates, key=lambda i: self.rate_of(i))
        self.unload(victim)
        self.stats.evictions += 1
        return True

    def unload(self, lora_int_id: int, forever: bool = False) -> None:
        """Drops the adapter from the workers' host caches (its KV blocks stay until evicted;
        ``forever``: the API side unloaded it, so kv_value says they are worthless)."""
        if forever:
            self.unloaded.add(lora_int_id)
        if self.loaded.pop(lora_int_id, None) is not None:
            self._remove(lora_int_id)
        blocks = self.blocks_of.pop(lora_int_id, None)
        if blocks is not None:
            self.pool.release(blocks)

    def snapshot(self, per_namespace: dict, cached_per_owner) -> "LoRAStatsSnapshot":
        """Counters for EngineStats: per adapter (by name) requests, loads and prefix-cache
        queries/hits; the cached blocks computed through adapters, and how many of those belong
        to adapters not in the host caches."""
        names = {lora_id: lora.lora_name for lora_id, lora in self.requests.items()}
        prefix: dict[str, list[int]] = {}
        for key, (queries, hits) in per_namespace.items():
            lora_id = self.owner_of.get(key)
            if lora_id:
                counts = prefix.setdefault(names[lora_id], [0, 0])
                counts[0] += queries
                counts[1] += hits
        cached = not_resident = 0
        for owner, count in cached_per_owner.items():
            lora_id = self.owner_of.get(owner)
            if lora_id:
                cached += count
                not_resident += 0 if lora_id in self.loaded else count
        adapters = tuple(AdapterCounters(name, s.requests, s.loads, *prefix.get(name, (0, 0)))
                         for name, s in sorted(self.stats.per_adapter.items()))
        return LoRAStatsSnapshot(self.stats.loads, self.stats.evictions, len(self.loaded),
                                 cached, not_resident, adapters,
                                 sum(len(b) for b in self.blocks_of.values()))

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self.loaded

    # ---- the prefix-cache namespace ---------------------------------------------------------
    def cache_key(self, lora: LoRARequest, info) -> tuple:
        key = ("lora", lora.lora_name if self.cache_policy == "vllm" else info.content_hash)
        self.owner_of[key] = lora.lora_int_id
        return key

    def kv_value(self, owner: tuple) -> float:
        """What a namespace's cached KV blocks are worth keeping (the KV pool's evict_value):
        the decayed request rate of its adapter (or of the base model), -1 for an adapter that
        was unloaded (no request can ever hit its blocks), 0 for namespaces it does not know."""
        lora_id = self.owner_of.get(owner)
        if lora_id is None:
            return 0.0
        if lora_id in self.unloaded:
            return -1.0
        return self.rate_of(lora_id)

    # ---- how valuable an adapter's weights and KV are ---------------------------------------
    HALF_LIFE_S = 60.0  # as the KV pool's block use counts (memwall/core/kv/block_pool.py)

    def observe(self, lora_int_id: int) -> None:
        self._decay()
        self.rate[lora_int_id] = self.rate.get(lora_int_id, 0.0) + 1.0

    def rate_of(self, lora_int_id: int) -> float:
        self._decay()
        return self.rate.get(lora_int_id, 0.0)

    def _decay(self) -> None:
        now = time.monotonic()
        factor = 0.5 ** ((now - self._rate_time) / self.HALF_LIFE_S)
        if factor < 0.999:
            for key in self.rate:
                self.rate[key] *= factor
            self._rate_time = now

    def _stats(self, lora: LoRARequest) -> AdapterStats:
        return self.stats.per_adapter.setdefault(lora.lora_name, AdapterStats())

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
