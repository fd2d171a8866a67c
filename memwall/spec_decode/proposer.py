"""The proposer interface: a drafter of tokens, asked once per step for the sequences that
just got a token."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    token_ids: np.ndarray
    """Every known token of the sequence (prompt, then output), int64 [n]."""
    max_drafts: int
    """Draft at most this many tokens (>= 1)."""


class Proposer(ABC):
    """Proposes draft tokens. A drafter with state per sequence (a draft model's KV cache)
    drops it in ``forget``."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """request id -> up to max_drafts draft tokens (absent or empty: no draft)."""

    def forget(self, request_ids: list[str]) -> None:
        """These sequences finished or lost their KV: drop anything kept for them."""
