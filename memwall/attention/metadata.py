"""AttentionMetadata: where this step's tokens sit in the flat batch and in the paged KV cache.

The runner flattens all scheduled chunks into one token axis:

    tokens:   [ a0 a1 a2 a3 | b7 | c0 c1 ]       (a: prefill chunk, b: decode, c: prefill chunk)
    seq:        query_start = [0, 4, 5, 7]
    context:    seq_lens    = [4, 8, 2]         (KV length after this step's tokens are written)

``slot_mapping[t]`` is the cache slot (block_id * block_size + offset) that token t writes its
K/V into; ``block_tables[s]`` lists sequence s's blocks (padded with 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    decode: "DecodeBatch | None" = None
    """Per-step tensors for the decode sequences, shared by every layer."""
    backend: str = "torch"
    """Which attention backend runs this step: torch or triton (memwall/attention/backend.py)."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu",
              backend: str = "torch") -> "AttentionMetadata":
        query_start = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            query_start.append(query_start[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        decode_ids = [i for i, q in enumerate(query_lens) if q == 1]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=query_start,
            seq_lens=list(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            block_size=block_size,
            decode_seq_ids=decode_ids,
            prefill_seq_ids=[i for i, q in enumerate(query_lens) if q > 1],
            decode=DecodeBatch.build(decode_ids, query_start, seq_lens, block_tables, block_size,
                                     device) if decode_ids and backend == "torch" else None,
            backend=backend,
        )


@dataclass
class DecodeBatch:
    """The decode sequences of a step, prepared once and read by every layer.

    ``contiguous_start``: when a single sequence's blocks happen to be consecutive (the usual
    case for one stream, as the pool hands blocks out in order), attention reads a view of the
    cache instead of gathering a copy of it.
    """

    token_index: torch.Tensor  # [B] rows of the flat token axis
    block_tables: torch.Tensor  # [B, num_blocks]
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, max_len] additive (0 / -inf), None when all lengths equal
    contiguous_start: int | None = None
    num_blocks: int = field(default=0)
    seq_lens: torch.Tensor | None = None  # [B] int64, KV length of each decode sequence

    @classmethod
    def build(cls, seq_ids: list[int], query_start: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int, device) -> "DecodeBatch":
        lens = [seq_lens[s] for s in seq_ids]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        tables = [block_tables[s][:num_blocks] + [0] * (num_blocks - len(block_tables[s][:num_blocks]))
                  for s in seq_ids]
        mask = None
        if min(lens) != max_len:
            valid = torch.arange(max_len) < torch.tensor(lens).unsqueeze(1)  # [B, max_len]
            mask = torch.zeros(len(lens), max_len).masked_fill_(~valid, float("-inf"))
            mask = mask.view(len(lens), 1, 1, max_len).to(device)
        start = None
        if len(seq_ids) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + num_blocks)):
            start = tables[0][0]
        return cls(torch.tensor([query_start[s] for s in seq_ids], device=device),
                   torch.tensor(tables, dtype=torch.long, device=device), max_len, mask, start,
                   num_blocks, torch.tensor(lens, dtype=torch.long, device=device))
