"""Logprobs of the raw logits: the chosen token's, its rank, and the top k."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, 1 + k] int64: column 0 = sampled/given token, then the top-k ids
    logprobs: torch.Tensor  # [B, 1 + k] float32
    ranks: torch.Tensor  # [B] int64: rank of the column-0 token (1 = most likely)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-softmax of the RAW logits (before penalties, temperature, top-k: vLLM V1 semantics),
    so that the numbers describe the model, not the sampling settings."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).view(-1, 1)  # [B, 1]
    chosen = logprobs.gather(1, token_ids)  # [B, 1]
    # Rank = 1 + number of strictly more likely tokens, so ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [B]
    k = min(k, logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [B, k], sorted descending
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),  # [B, 1 + k]
        logprobs=torch.cat([chosen, top_values], dim=1),  # [B, 1 + k]
        ranks=ranks,
    )
