"""Structured outputs in the sampler: tokens a request's grammar does not allow get -inf.

A bitmask row holds ceil(vocab / 32) int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed (memwall/structured/backend.py). A row of all ones (-1) is a request
without a constraint; only constrained rows are unpacked.
"""

from __future__ import annotations

import numpy as np
import torch

def stack_bitmask(rows: list[np.ndarray | None]) -> torch.Tensor | None:
    """One [B, W] int32 tensor from per-row masks (None: unconstrained); None if all are None."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    out = np.full((len(rows), present[0].shape[-1]), -1, dtype=np.int32)  # [B, W]
    for i, row in enumerate(rows):
        if row is not None:
            out[i] = row
    return torch.from_numpy(out)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] where ``bitmask`` [B, W] clears a token's bit become -inf.
    Tokens past 32 * W (logit rows wider than the tokenizer's mask) are disallowed too.

    The bits are unpacked by numpy on the host (a few microseconds a row; torch's shift-and-mask
    took ~3x longer) and the -inf written with one masked_fill."""
    words = bitmask.cpu().numpy()  # [B, W]
    rows = np.flatnonzero((words != -1).any(axis=1))  # [R] the constrained rows
    if rows.size == 0:
        return
    vocab = logits.shape[-1]
    # unpack the complement: a set bit is a token to drop
    drop = np.unpackbits((~words[rows]).view(np.uint8), axis=1, bitorder="little")  # [R, 32W]
    if drop.shape[1] < vocab:
        drop = np.pad(drop, ((0, 0), (0, vocab - drop.shape[1])), constant_values=1)
    mask = torch.from_numpy(np.ascontiguousarray(drop[:, :vocab]).view(np.bool_)).to(logits.device)
    if rows.size == logits.shape[0]:
        logits.masked_fill_(mask, float("-inf"))
        return
    index = torch.from_numpy(rows).to(logits.device)
    logits[index] = logits[index].masked_fill(mask, float("-inf"))
