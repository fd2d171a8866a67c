"""The drafters' own KV pool: blocks per sequence, and the one-token rows a short step takes."""

from __future__ import annotations

import numpy as np
import torch

from memwall.attention.metadata import one_token_rows
from memwall.spec_decode.draft_cache import DraftCache


def cache(num_blocks=16, block_size=4) -> DraftCache:
    pool = torch.zeros(num_blocks, block_size, 1, 2)
    return DraftCache([(pool, pool.clone())], block_size)


def test_rows_are_the_one_token_rows_of_the_step():
    """Entries first .. first + count - 1 of each sequence as one-token rows: the same slots,
    lengths and tables as the target's verify layout (attention.metadata.one_token_rows), for
    spans that cross block boundaries and sequences with different block counts."""
    draft = cache()
    assert draft.reserve("a", 11) and draft.reserve("b", 3) and draft.reserve("c", 8)
    spans = [("a", 6, 4), ("b", 0, 3), ("c", 7, 1)]  # a: entries 6..9 (blocks 1 and 2)
    slots, lens, tables = draft.rows(spans)
    width = max(len(draft.blocks[r]) for r, _, _ in spans)
    padded = np.array([draft.blocks[r] + [0] * (width - len(draft.blocks[r])) for r, _, _ in spans])
    counts = np.array([c for _, _, c in spans])
    starts = np.array([f for _, f, _ in spans])
    query, seq, want_tables = one_token_rows(np.ones(3, dtype=bool), counts, starts, starts + counts,
                                             padded)
    assert (query == 1).all()
    assert lens.tolist() == seq.tolist() == [7, 8, 9, 10, 1, 2, 3, 8]
    assert torch.equal(tables, torch.from_numpy(want_tables))
    bs = draft.block_size
    want_slots = [draft.blocks[r][e // bs] * bs + e % bs for r, f, c in spans for e in range(f, f + c)]
    assert slots.tolist() == want_slots
    assert slots.dtype == lens.dtype == tables.dtype == torch.long
