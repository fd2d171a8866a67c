"""Banned tokens and the repetition / presence / frequency penalties, applied in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memwall.sample.metadata import SamplingMetadata


def apply_banned_tokens(logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Set logits[i, t] = -inf for every t in banned[i] (one indexed write for the batch)."""
    rows, cols = _flatten(banned, range(len(banned)), logits.device)  # [N], [N]
    if rows.numel():
        logits[rows, cols] = float("-inf")


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Repetition (CTRL: shrink towards 0 by p, i.e. logit/p if positive else logit*p) over
    prompt + output tokens; frequency (-f * count) and presence (-p * seen) over output only."""
    rep = meta.repetition_penalty.to(logits.device)  # [B]
    freq = meta.frequency_penalty.to(logits.device)  # [B]
    pres = meta.presence_penalty.to(logits.device)  # [B]
    rep_list, freq_list, pres_list = rep.tolist(), freq.tolist(), pres.tolist()
    # Only rows with a penalty on pay for turning their (possibly long) token lists into tensors.
    rep_rows = [i for i, p in enumerate(rep_list) if p != 1.0]
    out_rows = [i for i in range(len(rep_list)) if rep_list[i] != 1.0 or freq_list[i] or pres_list[i]]
    counts = _token_counts(meta.output_token_ids, out_rows, logits)  # [B, V]
    seen_output = counts > 0  # [B, V]
    if rep_rows:
        seen = seen_output | (_token_counts(meta.prompt_token_ids, rep_rows, logits) > 0)  # [B, V]
        # Rows without a repetition penalty have p = 1, so the full-batch where() leaves them alone.
        penalty = torch.where(seen, rep[:, None], torch.ones_like(logits))  # [B, V]
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))  # [B, V]
    logits -= freq[:, None] * counts  # [B, V]
    logits -= pres[:, None] * seen_output.float()  # [B, V]


def _token_counts(token_lists: list[list[int]], rows_wanted: list[int],
                  logits: torch.Tensor) -> torch.Tensor:
    """counts[i, t] = how often t occurs in token_lists[i] for the wanted rows; other rows stay 0."""
    counts = torch.zeros_like(logits)  # [B, V] float32
    rows, cols = _flatten(token_lists, rows_wanted, logits.device)  # [N], [N]
    if rows.numel():
        counts.index_put_((rows, cols), torch.ones_like(rows, dtype=counts.dtype), accumulate=True)
    return counts


def _flatten(lists: list[list[int]], rows_wanted: Iterable[int],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors for every (i, t) with t in lists[i] and i in rows_wanted."""
    rows = [i for i in rows_wanted for _ in lists[i]]
    cols = [t for i in rows_wanted for t in lists[i]]
    return (torch.tensor(rows, dtype=torch.int64, device=device),  # [N]
            torch.tensor(cols, dtype=torch.int64, device=device))  # [N]
