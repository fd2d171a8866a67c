"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens are likely to follow again. Free to compute, and strong wherever
the output copies its input: summaries, code edits, answers quoting a passage, extraction.

    tokens:  ... def area ( r ) : return 3.14 * r * r  ...  def area ( r ) :
                 └── suffix match (n = 4: "area ( r ) :" ) ─┘              └─ suffix
    draft:   return 3.14 * r            (the k tokens after the match)

Longer suffixes are tried first (prompt_lookup_max down to prompt_lookup_min): a longer match
is more specific, so its continuation is more often right.
"""

from __future__ import annotations

import numpy as np

from memwall.spec_decode.proposer import DraftRequest, Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def drafts_free(self, request_id: str, token_ids: np.ndarray) -> bool:
        return True  # a lookup is a few array compares

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            draft = self.lookup(request.token_ids, request.max_drafts)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest suffix that has
        one (empty when none does)."""
        begin = self.match(tokens) if k >= 1 else None
        return [] if begin is None else tokens[begin:begin + k].tolist()

    def match(self, tokens: np.ndarray) -> int | None:
        """Where the tokens following the latest earlier match of the longest suffix that has
        one start (always before the end), or None when no suffix has one."""
        length = len(tokens)
        if length < self.min_n + 1:
            return None
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # candidate starts: where the suffix's first token occurs with a token after the match
            starts = np.flatnonzero(tokens[:length - n] == suffix[0])
            for i in range(1, n):  # keep the candidates whose next tokens match too
                starts = starts[tokens[starts + i] == suffix[i]]
                if not len(starts):
                    break
            if len(starts):
                return int(starts[-1]) + n
        return None
