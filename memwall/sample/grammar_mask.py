"""Structured outputs in the sampler: tokens a request's grammar does not allow get -inf.

A bitmask row holds ceil(vocab / 32) int32 words, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed (memwall/structured/backend.py). A row of all ones (-1) is a request
without a constraint; only constrained rows are unpacked.
"""

from __future__ import annotations

import numpy as np
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)  # [32]


def stack_bitmask(rows: list[np.ndarray | None], words: int | None = None) -> torch.Tensor | None:
    """One [B, W] int32 tensor from per-row masks (None: unconstrained); None if all are None."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    width = words or present[0].shape[-1]
    out = np.full((len(rows), width), -1, dtype=np.int32)  # [B, W]
    for i, row in enumerate(rows):
        if row is not None:
            out[i] = row
    return torch.from_numpy(out)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [B, V] where ``bitmask`` [B, W] clears a token's bit become -inf.
    Tokens past 32 * W (logit rows wider than the tokenizer's mask) are disallowed too."""
    constrained = (bitmask != -1).any(dim=1).nonzero().flatten()  # [R]
    if constrained.numel() == 0:
        return
    vocab = logits.shape[-1]
    words = bitmask[constrained]  # [R, W]
    bits = (words.unsqueeze(-1) >> _SHIFTS) & 1  # [R, W, 32]
    allowed = bits.reshape(len(constrained), -1).to(torch.bool)  # [R, 32W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device)  # [R, V]
    index = constrained.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
