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

import numpy as np
import torch


def one_token_rows(expand: np.ndarray, query_lens: np.ndarray, start: np.ndarray,
                   seq_lens: np.ndarray, tables: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention's view of a step in which each sequence with ``expand`` set becomes one
    single-token row per token, row j as long as the sequence through its token j, all sharing
    the sequence's blocks (each row's KV is written before any row attends, so row j sees tokens
    0..j of this step); the others stay one row of ``query_lens`` tokens. The one-token kernels
    (the fused CPU decode step) then take the expanded rows: the target verifying drafts
    (worker/input_batch.py); a drafter feeding a few tokens builds the same rows directly
    (spec_decode/draft_cache.py ``DraftCache.rows``).
    ``start``: each sequence's length before this step. -> (query_lens, seq_lens, tables) a row."""
    counts = np.where(expand, query_lens, 1)  # attention rows per sequence
    seq_of_row = np.repeat(np.arange(len(query_lens)), counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    expanded = expand[seq_of_row]
    row_query = np.where(expanded, 1, query_lens[seq_of_row])
    row_seq = np.where(expanded, start[seq_of_row] + offset + 1, seq_lens[seq_of_row])
    return row_query, row_seq, tables[seq_of_row]


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
    """The attention backend that built it: torch, cpu or triton (memwall/attention/backend.py)."""

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
                                     device) if decode_ids and backend != "triton" else None,
            backend=backend,
        )

    @classmethod
    def from_arrays(cls, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: torch.Tensor,
                    slot_mapping: torch.Tensor, block_size: int,
                    backend: str = "torch") -> "AttentionMetadata":
        """The runner's fast path: per-sequence numpy arrays and device tensors it already built
        (``block_tables`` [S, W] covers every sequence's blocks)."""
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        is_decode = query_lens == 1
        decode_ids = np.flatnonzero(is_decode)
        decode = None
        if len(decode_ids) and backend != "triton":
            decode = DecodeBatch.from_arrays(decode_ids, query_start, seq_lens, block_tables,
                                             block_size, with_mask=backend == "torch")
        return cls(slot_mapping=slot_mapping, query_start=query_start.tolist(),
                   seq_lens=seq_lens.tolist(), block_tables=block_tables, block_size=block_size,
                   decode_seq_ids=decode_ids.tolist(),
                   prefill_seq_ids=np.flatnonzero(~is_decode).tolist(), decode=decode,
                   backend=backend)


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The reference backend's: ``decode`` holds a padded batch with an additive mask."""


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """The cpu backend's: ``decode`` holds each sequence's length and table, no padding mask
    (the native kernel stops at each sequence's own length)."""


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """The triton backend's: no host-side decode batch; the device plans it needs are built
    on first use and cached on it (memwall/attention/triton_backend.py)."""


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
    def from_arrays(cls, seq_ids: np.ndarray, query_start: np.ndarray, seq_lens: np.ndarray,
                    block_tables: torch.Tensor, block_size: int, with_mask: bool) -> "DecodeBatch":
        """``with_mask``: the additive padding mask the torch reference needs (the native
        kernel reads each sequence's own length instead)."""
        device = block_tables.device
        lens = seq_lens[seq_ids]
        max_len = int(lens.max())
        num_blocks = -(-max_len // block_size)
        every = len(seq_ids) == block_tables.shape[0]
        index = torch.from_numpy(seq_ids).to(device)
        tables = block_tables[:, :num_blocks] if every else block_tables[index, :num_blocks]
        mask = None
        if with_mask and int(lens.min()) != max_len:
            valid = torch.arange(max_len) < torch.from_numpy(lens).unsqueeze(1)  # [B, max_len]
            mask = torch.zeros(len(lens), max_len).masked_fill_(~valid, float("-inf"))
            mask = mask.view(len(lens), 1, 1, max_len).to(device)
        start = None
        if len(seq_ids) == 1:
            first = tables[0].tolist()
            if first == list(range(first[0], first[0] + num_blocks)):
                start = first[0]
        return cls(torch.from_numpy(query_start[seq_ids]).to(device), tables.contiguous(), max_len,
                   mask, start, num_blocks, torch.from_numpy(lens).to(device))

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
