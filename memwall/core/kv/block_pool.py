"""BlockPool: free list, reference counts and the prefix cache of the paged KV cache.

The KV cache is one big tensor cut into ``num_blocks`` blocks of ``block_size`` token slots each.
The pool only does bookkeeping on block ids; it never touches tensors, so it is tested without a
model. A sequence owns a list of block ids (its block table):

    seq A block table: [7, 2, 9]     tokens 0-15 -> block 7, 16-31 -> block 2, 32-40 -> block 9
    seq B block table: [7, 4]        shares block 7 (same first 16 tokens): ref_count[7] == 2

Prefix caching: a *full* block can be registered under the hash of its contents (see
hashing.py). When its last user frees it, it goes to the free list but keeps its hash, so a later
request with the same prefix can take it back (``touch``) instead of recomputing it. Only when a
fresh block is needed and no uncached one is left is the least recently freed cached block
evicted (its hash forgotten).

Each cached block also records its *owner*, the namespace it was computed in (a request's
``cache_extra_keys``, e.g. its LoRA adapter). By default eviction is least-recently-freed first,
whatever the owner. With ``evict_value`` set (the engine's adapter-aware LoRA policy), eviction
weighs what a block is worth keeping instead:

    1. a free block holding no cached contents (losing it costs nothing);
    2. a block of an owner whose ``evict_value`` is negative (an unloaded adapter: no request
       can ever hit it again, FastLibra's "invalid KV");
    3. the block least often used lately: each block counts its uses (computed once, then one
       per prefix hit), decayed with a half-life of ``HALF_LIFE_S``; ties go to the deeper
       block. A shared system prompt of a popular adapter outlives one-off tails and the
       prompts of adapters asked for once, which least-recently-freed order cannot tell apart;
       a prefix is never evicted before its own continuation (every hit of a block passes
       through its parents).

Invariants (property-tested): every block is either free (ref_count == 0, in the free list) or in
use (ref_count >= 1, not in the free list); a block in use is never handed out; a hash maps to
exactly one block and that block carries that hash.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, OrderedDict
from typing import Callable, Hashable

HALF_LIFE_S = 60.0
"""How fast a block's use count fades (adapter-aware eviction)."""


def _log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    hi, lo = max(a, b), min(a, b)
    return hi + math.log2(1.0 + 2.0 ** (lo - hi)) if lo > -math.inf else hi


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_owner: list[Hashable] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        """hash -> block id, for full blocks whose contents are known."""
        self.cached_per_owner: Counter = Counter()
        """owner -> cached blocks (in use or free) computed in its namespace."""
        # Free blocks in the order they were freed (least recent first): an OrderedDict gives
        # O(1) removal from the middle when a cached free block is taken back. The same blocks
        # are also kept split by what eviction would lose: nothing (_free_plain) or an owner's
        # cached contents (_free_cached), for evict_value.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_plain: OrderedDict[int, None] = OrderedDict(self._free)
        self._free_cached: dict[Hashable, OrderedDict[int, None]] = {}
        self.num_evictions = 0
        self.evict_value: Callable[[Hashable], float] | None = None
        """None: evict least recently freed first. Else owner -> what its cached KV is worth
        (negative: nothing, evicted first); blocks then go least used first."""
        # Adapter-aware eviction: each block's decayed use count as log2(count * 2^(t / H)) (one
        # clock for all, so fading never reorders blocks and nothing is rescaled), its depth in
        # its sequence, and a heap of free cached blocks (entries of blocks taken back since are
        # skipped when popped).
        self._score = [-math.inf] * num_blocks
        self._depth = [0] * num_blocks
        self._heap: list[tuple[float, int, int, int]] = []
        self._heap_seq = itertools.count()
        self._heap_entry = [-1] * num_blocks
        self._clock0 = time.monotonic()
        self.reclaim: Callable[[float | None], bool] | None = None
        """The unified pool (memwall/lora/registry.py): given what the next cached block to
        evict is worth keeping (its decayed use count x ``block_cost_s``; None: a block must be
        found), drops an idle LoRA adapter parked in blocks of this pool if it is worth less,
        releasing its blocks; True if it did."""
        self.block_cost_s = 0.0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0 (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` free blocks (ref_count 1 each), evicting cached ones if it must."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id = self._next_victim()
            self._take_free(block_id)
            self._forget_hash(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def _next_victim(self) -> int:
        if self.evict_value is None:
            return next(iter(self._free))
        if self._free_plain:
            return next(iter(self._free_plain))
        dead = next((o for o in self._free_cached if self.evict_value(o) < 0), None)
        if dead is not None:
            return next(iter(self._free_cached[dead]))
        while True:  # the least used free cached block (stale heap entries skipped)
            score, _, seq, block_id = self._heap[0]
            if self._heap_entry[block_id] == seq and self.ref_counts[block_id] == 0:
                break
            heapq.heappop(self._heap)
        if self.reclaim is not None:  # or an idle adapter, if it is worth less per block
            if self.reclaim(2.0 ** (score - self._now()) * self.block_cost_s) and self._free_plain:
                return next(iter(self._free_plain))
        return block_id

    def _compact_heap(self) -> None:
        """Drops the entries of blocks taken back since they were freed."""
        self._heap = [e for e in self._heap
                      if self._heap_entry[e[3]] == e[2] and self.ref_counts[e[3]] == 0]
        heapq.heapify(self._heap)

    def _now(self) -> float:
        """The use counts' clock, in half-lives."""
        return (time.monotonic() - self._clock0) / HALF_LIFE_S

    def _use(self, block_id: int) -> None:
        """One more use of a cached block (adapter-aware eviction's count)."""
        self._score[block_id] = _log2_add(self._score[block_id], self._now())

    def _take_free(self, block_id: int) -> None:
        del self._free[block_id]
        if self.block_hash[block_id] is None:
            del self._free_plain[block_id]
            return
        owner = self.block_owner[block_id]
        group = self._free_cached[owner]
        del group[block_id]
        if not group:
            del self._free_cached[owner]

    def touch(self, block_ids: list[int]) -> None:
        """Adds one reference to each block, taking free (cached) ones back from the free list."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                self._take_free(block_id)
            self.ref_counts[block_id] += 1
            if self.evict_value is not None and self.block_hash[block_id] is not None:
                self._use(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; blocks that reach zero go to the free list's end
        (cached ones keep their hash and stay findable until evicted)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} released more often than it was taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.block_hash[block_id] is None:
                    self._free_plain[block_id] = None
                else:
                    owner = self.block_owner[block_id]
                    self._free_cached.setdefault(owner, OrderedDict())[block_id] = None
                    if self.evict_value is not None:
                        if len(self._heap) > 4 * self.num_blocks:
                            self._compact_heap()
                        seq = next(self._heap_seq)
                        self._heap_entry[block_id] = seq
                        heapq.heappush(self._heap, (self._score[block_id],
                                                    -self._depth[block_id], seq, block_id))

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: bytes, owner: Hashable = None,
                 depth: int = 0) -> None:
        """Records that a full block in use holds the contents named by ``block_hash``,
        computed in ``owner``'s namespace, as block ``depth`` of its sequence.

        If another block already holds the same contents the first one stays the cached copy.
        """
        if self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        assert self.ref_counts[block_id] > 0, "only a block in use is registered"
        self.block_hash[block_id] = block_hash
        self.block_owner[block_id] = owner
        self.cached[block_hash] = block_id
        self.cached_per_owner[owner] += 1
        self._depth[block_id] = depth
        self._score[block_id] = -math.inf
        if self.evict_value is not None:
            self._use(block_id)  # computed once: its first use

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            owner = self.block_owner[block_id]
            self.cached_per_owner[owner] -= 1
            if not self.cached_per_owner[owner]:
                del self.cached_per_owner[owner]
            self.block_owner[block_id] = None
            self._heap_entry[block_id] = -1
            self.num_evictions += 1
