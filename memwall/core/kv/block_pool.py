"""BlockPool: the free list and reference counts of the paged KV cache.

The KV cache is one big tensor cut into ``num_blocks`` blocks of ``block_size`` token slots each.
The pool only does bookkeeping on block ids; it never touches tensors, so it is tested without a
model. A sequence owns a list of block ids (its block table):

    seq A block table: [7, 2, 9]     tokens 0-15 -> block 7, 16-31 -> block 2, 32-40 -> block 9
    seq B block table: [4]           (block 9 has 7 free slots; only the last block is partial)

Invariants: every block is either free (ref_count == 0, in the free list) or in use
(ref_count >= 1, not in the free list); a block in use is never handed out again.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free blocks in the order they were freed: allocation pops from the left.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` free blocks (ref_count 1 each); raises if fewer are free."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self.ref_counts[block_id] = 1
        return blocks

    def retain(self, block_ids: list[int]) -> None:
        """Adds one reference to blocks already in use (sharing them)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} is free and cannot be shared")
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; blocks that reach zero go back to the free list."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} released more often than it was taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.append(block_id)
