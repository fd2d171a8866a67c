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
    by_lookup: bool | None = None
    """Where a proposer can draft either way (lookup_first.py): True, from prompt lookup;
    False, from its model even where lookup has a match (its drafts were the likelier
    accepted, adaptive.py); None, lookup where it has a match."""


class Proposer(ABC):
    """Proposes draft tokens. A drafter with state per sequence (a draft model's KV cache)
    drops it in ``forget``."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """request id -> up to max_drafts draft tokens (absent or empty: no draft)."""

    wants_features = False
    """True: the runner hands over the target's hidden states (``record``) every step."""

    def record(self, request_id: str, start: int, features) -> None:
        """The target's final hidden states [n, H] (after its last norm) for positions
        start .. start + n - 1 of a sequence, which this step made final (prompt chunks,
        decoded tokens, accepted drafts). Only called where ``wants_features``."""

    def forget(self, request_ids: list[str]) -> None:
        """These sequences finished or lost their KV: drop anything kept for them."""

    def drafts_free(self, request_id: str, token_ids: np.ndarray) -> bool:
        """Whether this sequence's next drafts (``token_ids``: all its tokens) would cost no
        drafting time: prompt lookup's. The adaptive lengths price them free and keep their
        acceptance apart from the drafter's (adaptive.py). Asked each step before ``propose``
        for the same tokens."""
        return False

    lookup_or_model = False
    """True where a sequence that ``drafts_free`` may also draft from the proposer's model
    instead (lookup_first.py): the runner then prices both and asks for the better."""

    def priced_tokens(self, drafts: dict[str, list[int]]) -> int:
        """How many of ``drafts`` (this proposer's last answer) cost drafting time: the
        adaptive draft lengths divide the call's time by it (0: the call is not timed). All
        of them, unless some were drafted for free (lookup_first.py)."""
        return sum(len(d) for d in drafts.values())
