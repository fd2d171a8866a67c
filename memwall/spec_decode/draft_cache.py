"""The paged KV pool of a drafter that keeps a cache of its own (a draft model, an EAGLE head):
blocks per sequence from a free list, and the attention layout of a step that appends entries.

A sequence whose blocks do not fit gets none (its cache is dropped and it drafts nothing that
step): the target never waits for the drafter, and nothing is evicted.
"""

from __future__ import annotations

import numpy as np
import torch

from memwall.attention.metadata import AttentionMetadata


class DraftCache:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        """``kv_caches``: the drafter's own pool (worker/kv_cache.allocate_kv_cache)."""
        self.kv_caches, self.block_size = kv_caches, block_size
        self.free = list(range(kv_caches[0][0].shape[0] - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.device = kv_caches[0][0].device

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def reserve(self, request_id: str, entries: int) -> bool:
        """Blocks for ``entries`` cache rows of a sequence; False, and its blocks freed (its
        cache is gone), when the pool has too few."""
        blocks = self.blocks.setdefault(request_id, [])
        need = -(-entries // self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > len(self.free):
            self.release(request_id)
            return False
        blocks.extend(self.free.pop() for _ in range(need))
        return True

    def release(self, request_id: str) -> None:
        self.free.extend(reversed(self.blocks.pop(request_id, [])))

    def metadata(self, backend, spans: list[tuple[str, int, int]]) -> AttentionMetadata:
        """A step in which each sequence (request id, first entry, count) writes entries
        first .. first + count - 1 and attends to its entries 0 .. first + count - 1 (the
        model's own forward; ``rows`` is the fused CPU step's view of a short one)."""
        bs = self.block_size
        counts = np.array([count for _, _, count in spans], dtype=np.int64)
        ends = np.array([first + count for _, first, count in spans], dtype=np.int64)
        tables = np.zeros((len(spans), max(len(self.blocks[r]) for r, _, _ in spans)), dtype=np.int64)
        slots = []
        for row, (request_id, first, count) in enumerate(spans):
            blocks = self.blocks[request_id]
            tables[row, :len(blocks)] = blocks
            slots.extend(blocks[e // bs] * bs + e % bs for e in range(first, first + count))
        dev = self.device
        return backend.build_metadata(counts, ends, torch.from_numpy(tables).to(dev),
                                      torch.tensor(slots, dtype=torch.long, device=dev), bs)

    def rows(self, spans: list[tuple[str, int, int]]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step of ``metadata`` with each entry a one-token row (the layout in which the
        target verifies drafts, attention.metadata.one_token_rows): a step of a few entries a
        sequence is then a decode step, which the fused CPU step takes (a sequence whose drafts
        were all accepted feeds its last draft and the sampled token; as a two-token prefill
        that went through the model's per-layer Python instead). Returns what that step reads,
        per row: its cache slot, its length (the entries it attends, itself included) and its
        sequence's block table. Built directly: a drafted token costs ~1 ms, and the attention
        metadata took 0.16 ms of it (numpy, and fields no C step reads)."""
        bs, width = self.block_size, max(len(self.blocks[r]) for r, _, _ in spans)
        slots, lens, tables = [], [], []
        for request_id, first, count in spans:
            blocks = self.blocks[request_id]
            padded = blocks + [0] * (width - len(blocks))
            for entry in range(first, first + count):
                slots.append(blocks[entry // bs] * bs + entry % bs)
                lens.append(entry + 1)
                tables.append(padded)
        dev = self.device
        return (torch.tensor(slots, dtype=torch.long, device=dev),
                torch.tensor(lens, dtype=torch.long, device=dev),
                torch.tensor(tables, dtype=torch.long, device=dev))
