"""KVCacheManager: which blocks each request holds, prefix-cache hits, forks and swapping.

The scheduler asks ``allocate_slots(request, num_tokens)`` before it schedules tokens: the
request's block table grows until it has room for ``num_tokens`` tokens in all. The manager
answers False (allocating nothing) when the pool is short, and the scheduler then preempts.

Data movement the runner must do before the next forward pass is queued here and handed over
with the step (``take_transfers``): copy-on-write block copies, and swap-out / swap-in copies
between the device pool and the secondary (host) pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memwall.core.kv.block_pool import BlockPool
from memwall.core.kv.hashing import extend_block_hashes
from memwall.core.step import BlockTransfers
from memwall.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens whose KV was found."""
    per_namespace: dict = field(default_factory=dict)
    """cache_extra_keys -> [queries, hits] (per LoRA adapter, per cache salt)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.swapped_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self._transfers = BlockTransfers()
        self._rewritten: set[str] = set()

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the longest cached prefix of the request's known tokens.

        At least one token is always left to compute (its logits are needed to sample), and a
        request that asks for prompt logprobs is not served from the cache (they need every
        position's logits).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            request.cache_extra_keys)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(blocks) * self.block_size
        counts = self.stats.per_namespace.setdefault(request.cache_extra_keys, [0, 0])
        counts[0] += request.num_tokens
        counts[1] += len(blocks) * self.block_size
        return blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that ``num_computed_tokens`` has just filled."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        if full <= done:
            return
        hashed = len(request.block_hashes) * self.block_size
        extend_block_hashes(request.block_hashes, request.tokens_from(hashed), self.block_size,
                            request.cache_extra_keys, hashed)
        for index in range(done, full):
            self.pool.register(table[index], request.block_hashes[index], request.cache_extra_keys,
                               index)
        self._num_registered[request.request_id] = full

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grows the block table to hold ``num_tokens`` tokens, first adopting ``cached_blocks``
        (only for a request that holds no blocks yet) and copying a shared partial block before
        it is written (copy on write). False, with nothing changed, if the pool is short."""
        rid = request.request_id
        table = self.block_tables.get(rid, [])
        assert not (cached_blocks and table), "cached blocks are adopted only on admission"
        new = max(0, blocks_needed(num_tokens, self.block_size) - len(table) - len(cached_blocks))
        cow_index = self._shared_block_to_write(table, request.num_computed_tokens, num_tokens)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        need = new + revived + (cow_index is not None)
        while need > self.pool.num_free_blocks and self.pool.reclaim is not None \
                and self.pool.reclaim(None):
            pass  # idle LoRA adapters parked in the pool make room before anyone is preempted
        if need > self.pool.num_free_blocks:
            return False
        self.pool.touch(list(cached_blocks))
        table = self.block_tables.setdefault(rid, [])
        if cached_blocks:
            table.extend(cached_blocks)
            self._num_registered[rid] = len(cached_blocks)  # already registered: they came from the cache
        if cow_index is not None:
            self._copy_on_write(table, cow_index)
            self._rewritten.add(rid)
        table.extend(self.pool.allocate(new))
        return True

    def _shared_block_to_write(self, table: list[int], start: int, end: int) -> int | None:
        """Index of a block that tokens [start, end) write into while others still read it."""
        index = start // self.block_size
        if start < end and index < len(table) and self.pool.ref_counts[table[index]] > 1:
            return index
        return None

    def _copy_on_write(self, table: list[int], index: int) -> None:
        [fresh] = self.pool.allocate(1)
        self._transfers.copies.append((table[index], fresh))
        self.pool.release([table[index]])
        table[index] = fresh

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Gives back the blocks past the first ``num_tokens`` tokens: blocks that only
        rejected draft tokens filled (never registered: their tokens were not computed)."""
        table = self.block_tables.get(request_id)
        keep = blocks_needed(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        self.pool.release(list(reversed(extra)))

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (including a partial last one, which is
        copied on the first write by either side)."""
        table = list(self.block_tables.get(parent.request_id, []))
        self.pool.touch(table)
        self.block_tables[child.request_id] = table
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, request_id: str) -> None:
        """Returns all of the request's blocks (device and swapped) to their pools."""
        blocks = self.block_tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        # Release the tail first: the free list is LRU, so a prompt's deep blocks (the least
        # likely to be shared) are evicted before its first blocks.
        self.pool.release(list(reversed(blocks)))
        host = self.swapped_tables.pop(request_id, [])
        if host:
            self.swap_pool.release(host)

    # ---- swapping --------------------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        held = len(self.block_tables.get(request_id, ()))
        return self.swap_pool is not None and 0 < held <= self.swap_pool.num_free_blocks

    def swap_out(self, request_id: str) -> None:
        """Moves the request's KV to the host pool; its device blocks are freed."""
        table = self.block_tables.pop(request_id)
        self._num_registered.pop(request_id, None)
        host = self.swap_pool.allocate(len(table))
        self._transfers.swap_out.extend(zip(table, host))
        self.pool.release(list(reversed(table)))
        self.swapped_tables[request_id] = host

    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        """Room to bring the request's blocks back and grow them to ``num_tokens`` tokens."""
        held = len(self.swapped_tables.get(request_id, ()))
        return max(held, blocks_needed(num_tokens, self.block_size)) <= self.pool.num_free_blocks

    def swap_in(self, request_id: str) -> None:
        host = self.swapped_tables.pop(request_id)
        device = self.pool.allocate(len(host))
        self._transfers.swap_in.extend(zip(host, device))
        self.swap_pool.release(host)
        self.block_tables[request_id] = device
        self._num_registered[request_id] = 0

    def take_rewritten(self) -> set[str]:
        """Requests whose block table changed other than at its end (copy on write) since the
        last call: a worker holding their old table must be sent the whole new one."""
        rewritten, self._rewritten = self._rewritten, set()
        return rewritten

    def take_transfers(self) -> BlockTransfers:
        transfers, self._transfers = self._transfers, BlockTransfers()
        return transfers
