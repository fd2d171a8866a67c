"""DPRouter: which data-parallel replica a request goes to (memwall/engine/dp_client.py).

Pure bookkeeping on token ids, no torch and no engine: tested in milliseconds.

Each replica has a prefix cache of its own, so a prompt is cheap only on the replica that
already holds its prefix. The router keeps, per replica, an approximate index of the prefixes
it has sent there, as SGLang's cache-aware router does, keyed the way the engine's prefix cache
is (memwall/core/kv/hashing.py): one chained hash per full block of ``block_size`` tokens, in
the request's cache namespace (LoRA adapter, cache salt), so

    prompt  [ block 0 | block 1 | block 2 | tail ]      h0 = H(root, block 0, ns), h1 = H(h0, ...)
    replica 0 index  {h0, h1, ...}   -> matches 2 blocks
    replica 1 index  {h0}            -> matches 1 block

The rule, for a request of ``m`` matched blocks on its best replica B (the longest match; ties to
the less loaded one, then round robin), with ``load`` = samples in flight per replica:

    m >= 1 and load[B] - min(load) <= threshold    -> B              (an affinity hit)
    otherwise                                       -> the least-loaded replica (ties: round robin)

    threshold = max(balance_abs, balance_rel x mean(load))         (defaults 2 and 0.25)

Why these numbers: a hit skips the prefill of the matched tokens, which costs as much as a
decode step per few dozen tokens (prefill is compute-bound, a decode step reads the weights
once for the whole batch); one or two more sequences in a replica's batch slow each of its
decode steps far less. So at low load affinity wins outright (the floor of 2), and the tolerated
imbalance grows with the load (25% of the mean), but not so far that one replica collects every
hot conversation while another idles: at 16 vs 8 in flight (mean 12, threshold 3) new work goes
to the idle one. SGLang's defaults tolerate much more (32 absolute and 1.5x relative, for GPUs
with far larger batches); ours suit CPU batches of a few dozen.

The index is an estimate: the engine evicts its cached blocks as memory runs short, and blocks
of generated text are cached there but not here. It is bounded: at most ``max_blocks`` hashes
per replica (DPCoreClient passes the replica's KV block count: the engine cannot keep more), the
least recently used forgotten first. A prompt's hashes go in deepest first, so its first block is
the most recent and an old prompt loses its tail before its prefix, as the engine's cache does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from memwall.core.kv.hashing import BlockHash, extend_block_hashes

DEFAULT_MAX_BLOCKS = 65536
"""Hashes remembered per replica when the caller gives no bound (~10 MB of Python objects)."""


@dataclass(frozen=True)
class RouterStats:
    """Routing counters since start (per replica lists are in replica order)."""

    routed: tuple[int, ...]
    """Requests sent to each replica (a request with n samples counts once)."""
    in_flight: tuple[int, ...]
    """Samples routed to each replica and not yet finished or aborted."""
    affinity_hits: int = 0
    """Requests sent where their longest known prefix was."""
    load_overrides: int = 0
    """Requests with a known prefix sent elsewhere because that replica was too busy."""
    matched_tokens: int = 0
    """Prompt tokens of the affinity hits that the index expected to be cached."""


class DPRouter:
    def __init__(self, num_replicas: int, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 balance_abs: float = 2.0, balance_rel: float = 0.25) -> None:
        """``max_blocks``: the most block hashes remembered per replica (LRU beyond it);
        ``balance_abs`` / ``balance_rel``: the threshold of the module docstring."""
        if num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {num_replicas}")
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size ({block_size}) and max_blocks ({max_blocks}) must "
                             f"be >= 1")
        self.num_replicas, self.block_size, self.max_blocks = num_replicas, block_size, max_blocks
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        # per replica: block hash -> None, least recently used first
        self._index: list[OrderedDict[BlockHash, None]] = [OrderedDict()
                                                           for _ in range(num_replicas)]
        self._load = [0] * num_replicas
        self._where: dict[str, int] = {}  # sample id -> replica, while in flight
        self._next = 0  # round-robin pointer for ties
        self._routed = [0] * num_replicas
        self._hits = self._overrides = self._matched_tokens = 0

    # ---- routing -----------------------------------------------------------------------------
    def route(self, sample_ids: list[str], token_ids: list[int], namespace: tuple = ()) -> int:
        """The replica for a request whose samples are ``sample_ids`` (all on one replica: they
        share the first one's prefill); records the prompt in that replica's index and counts
        the samples in flight there until ``finish``. ``namespace``: the request's cache keys
        (its LoRA adapter, a cache salt): the same tokens in another namespace do not match."""
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids, self.block_size, namespace)
        matches = [self._matched(r, hashes) for r in range(self.num_replicas)]
        replica = self._choose(matches)
        self._remember(replica, hashes)
        self._routed[replica] += 1
        for sample_id in sample_ids:
            self._where[sample_id] = replica
        self._load[replica] += len(sample_ids)
        return replica

    def threshold(self) -> float:
        """How much busier than the least-loaded replica an affinity target may be."""
        mean = sum(self._load) / self.num_replicas
        return max(self.balance_abs, self.balance_rel * mean)

    def _choose(self, matches: list[int]) -> int:
        least = self._tie_break(self._least_loaded(range(self.num_replicas)))
        longest = max(matches)
        if longest == 0:  # nothing known (or less than a block): balance the load
            return self._take(least)
        holders = [r for r, m in enumerate(matches) if m == longest]
        best = self._tie_break(self._least_loaded(holders))
        if self._load[best] - self._load[least] > self.threshold():
            self._overrides += 1
            return self._take(least)
        self._hits += 1
        self._matched_tokens += longest * self.block_size
        return self._take(best)

    def _least_loaded(self, replicas) -> list[int]:
        low = min(self._load[r] for r in replicas)
        return [r for r in replicas if self._load[r] == low]

    def _tie_break(self, tied: list[int]) -> int:
        """Round robin among ``tied``: the first at or after the pointer."""
        return min(tied, key=lambda r: (r - self._next) % self.num_replicas)

    def _take(self, replica: int) -> int:
        self._next = (replica + 1) % self.num_replicas  # the next tie starts after this one
        return replica

    # ---- the index ---------------------------------------------------------------------------
    def _matched(self, replica: int, hashes: list[BlockHash]) -> int:
        """Leading blocks of ``hashes`` this replica's index holds (the engine, too, reuses
        only an unbroken prefix)."""
        index = self._index[replica]
        return next((i for i, h in enumerate(hashes) if h not in index), len(hashes))

    def _remember(self, replica: int, hashes: list[BlockHash]) -> None:
        index = self._index[replica]
        for block_hash in reversed(hashes):  # deepest first: the prefix is the most recent
            index[block_hash] = None
            index.move_to_end(block_hash)
        while len(index) > self.max_blocks:
            index.popitem(last=False)

    def index_size(self, replica: int) -> int:
        """Block hashes remembered for a replica (at most max_blocks)."""
        return len(self._index[replica])

    # ---- in flight ---------------------------------------------------------------------------
    def finish(self, sample_id: str) -> int | None:
        """A sample finished or was aborted: it no longer loads its replica. Returns that
        replica; None for an id not in flight (already finished: calling twice is harmless)."""
        replica = self._where.pop(sample_id, None)
        if replica is not None:
            self._load[replica] -= 1
        return replica

    def replica_of(self, sample_id: str) -> int | None:
        """Where an in-flight sample runs (None once it finished)."""
        return self._where.get(sample_id)

    def load(self, replica: int) -> int:
        return self._load[replica]

    def stats(self) -> RouterStats:
        return RouterStats(tuple(self._routed), tuple(self._load), self._hits, self._overrides,
                           self._matched_tokens)


__all__ = ["DPRouter", "RouterStats", "DEFAULT_MAX_BLOCKS"]
