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

Invariants (property-tested): every block is either free (ref_count == 0, in the free list) or in
use (ref_count >= 1, not in the free list); a block in use is never handed out; a hash maps to
exactly one block and that block carries that hash.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        """hash -> block id, for full blocks whose contents are known."""
        # Free blocks in the order they were freed (least recent first): an OrderedDict gives
        # O(1) removal from the middle when a cached free block is taken back.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_evictions = 0

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
            block_id, _ = self._free.popitem(last=False)
            self._forget_hash(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Adds one reference to each block, taking free (cached) ones back from the free list."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; blocks that reach zero go to the free list's end
        (cached ones keep their hash and stay findable until evicted)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} released more often than it was taken")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Records that a full block in use holds the contents named by ``block_hash``.

        If another block already holds the same contents the first one stays the cached copy.
        """
        if self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.num_evictions += 1
