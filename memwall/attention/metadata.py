"""AttentionMetadata: where this step's tokens sit in the flat batch and in the paged KV cache.

The runner flattens all scheduled chunks into one token axis:

    tokens:   [ a0 a1 a2 a3 | b7 | c0 c1 ]       (a: prefill chunk, b: decode, c: prefill chunk)
    seq:        query_start = [0, 4, 5, 7]
    context:    seq_lens    = [4, 8, 2]         (KV length after this step's tokens are written)

``slot_mapping[t]`` is the cache slot (block_id * block_size + offset) that token t writes its
K/V into; ``block_tables[s]`` lists sequence s's blocks (padded with 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    block_size: int
    decode_seq_ids: list[int]
    """Sequences with exactly one query token: attended in one padded batch."""
    prefill_seq_ids: list[int]
    """Sequences with several query tokens: attended one by one with a causal mask."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        query_start = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            query_start.append(query_start[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=query_start,
            seq_lens=list(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            block_size=block_size,
            decode_seq_ids=[i for i, q in enumerate(query_lens) if q == 1],
            prefill_seq_ids=[i for i, q in enumerate(query_lens) if q > 1],
        )
