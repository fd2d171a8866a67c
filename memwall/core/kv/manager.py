"""KVCacheManager: which blocks each request holds, and whether a step's tokens fit.

The scheduler asks ``allocate_slots(request_id, num_tokens)`` before it schedules tokens: the
request's block table grows until it has room for ``num_tokens`` tokens in all. The manager
answers False (allocating nothing) when the pool is short, and the scheduler then preempts.
"""

from __future__ import annotations

from memwall.core.kv.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

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

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        return self._extra_blocks(request_id, num_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's block table to hold ``num_tokens`` tokens. False if the pool is short."""
        extra = self._extra_blocks(request_id, num_tokens)
        if extra > self.pool.num_free_blocks:
            return False
        if extra > 0:
            self.block_tables.setdefault(request_id, []).extend(self.pool.allocate(extra))
        else:
            self.block_tables.setdefault(request_id, [])
        return True

    def free(self, request_id: str) -> None:
        """Returns all of the request's blocks to the pool (no-op if it holds none)."""
        blocks = self.block_tables.pop(request_id, [])
        # Release in reverse so the tail blocks (least likely to be shared later) are reused first.
        self.pool.release(list(reversed(blocks)))

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        held = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - held)
