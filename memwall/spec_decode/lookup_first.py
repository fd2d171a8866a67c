"""Prompt lookup first, a drafter for the rest (speculative_config ``"lookup_first": true`` with
the draft_model or eagle method).

A chat reply restates its prompt and itself: in 20 ShareGPT chats, SmolLM2-135M's replies took
40% of their tokens from prompt-lookup verifications (2.7 tokens a verify, 60% of the drafts
accepted), where an EAGLE head drafting every token has 35-42% of its drafts accepted and pays
a small forward per drafted token. So a sequence whose last tokens recur earlier in it drafts
what followed there (ngram.py: free, often long), and the model drafts for the sequences with
no match. Where a sequence has a match, the adaptive lengths price both (adaptive.py
``choose_among``: lookup free, at its own acceptance estimate; the model at its drafting cost
and estimate) and the sequence drafts the better way (``DraftRequest.by_lookup``): code whose
earlier lines recur but do not repeat, whose lookup drafts keep failing, keeps the model's
drafts instead of none. Each draft is verified as any other, so the output is unchanged.

The drafter keeps following every sequence (an EAGLE head's features are recorded each step;
its cache catches up over the entries it skipped when the sequence next needs it), so a
sequence moves between the two from step to step.

Drafting time is measured per drafted token (adaptive.py) and must not take in that catch-up:
a draft model that first drafts for a sequence after its prompt-lookup stretch reads the whole
prompt through its own model first (Qwen2.5-Coder-0.5B: a second for a HumanEval prompt), and
that one call, divided by its 4 tokens, priced the 0.5B's drafts out for good (the draft pair
then ran at 1.04x, no drafts). So a call times drafting only where every sequence the drafter
served had its drafts from the drafter at its previous proposal too (``priced_tokens``).
"""

from __future__ import annotations

import numpy as np

from memwall.spec_decode.ngram import NgramProposer
from memwall.spec_decode.proposer import DraftRequest, Proposer


class LookupFirstProposer(Proposer):
    lookup_or_model = True

    def __init__(self, lookup: NgramProposer, drafter: Proposer) -> None:
        self.lookup, self.drafter = lookup, drafter
        self.wants_features = drafter.wants_features
        self._looked_up: set[str] = set()  # the last call's sequences drafted by lookup
        self._drafted: set[str] = set()  # sequences whose last proposal the drafter made
        self._timed = True  # whether the last call measures the drafter's per-token time
        self._matches: dict[str, tuple[int, int | None]] = {}
        """Per sequence, (tokens, lookup match) that drafts_free found this step: propose
        routes by them instead of searching again."""

    @property
    def drafting_model(self):
        """What one of the drafter's tokens runs (step_shape.measure_row_costs times it)."""
        return getattr(self.drafter, "drafting_model", None)

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts, rest = {}, []
        for r in requests:
            begin = None
            if r.by_lookup is not False:  # False: the drafter's, match or not
                seen = self._matches.get(r.request_id)
                fresh = seen is not None and seen[0] == len(r.token_ids)
                begin = seen[1] if fresh else self.lookup.match(r.token_ids)
            if begin is None:
                rest.append(r)
            else:
                drafts[r.request_id] = r.token_ids[begin:begin + r.max_drafts].tolist()
        self._matches.clear()
        self._looked_up = set(drafts)
        self._timed = all(r.request_id in self._drafted for r in rest)
        self._drafted.difference_update(self._looked_up)
        self._drafted.update(r.request_id for r in rest)
        if rest:
            drafts.update(self.drafter.propose(rest))
        return drafts

    def drafts_free(self, request_id: str, token_ids: np.ndarray) -> bool:
        """True where lookup has a match: the sequence's drafts will be lookup's."""
        begin = self.lookup.match(token_ids)
        self._matches[request_id] = (len(token_ids), begin)
        return begin is not None

    def priced_tokens(self, drafts: dict[str, list[int]]) -> int:
        """The drafter's tokens; 0 (the call is not timed) where the drafter caught up on a
        sequence it did not draft for at that sequence's previous proposal (module docstring)."""
        if not self._timed:
            return 0
        return sum(len(d) for rid, d in drafts.items() if rid not in self._looked_up)

    def record(self, request_id: str, start: int, features) -> None:
        self.drafter.record(request_id, start, features)

    def forget(self, request_ids: list[str]) -> None:
        self._drafted.difference_update(request_ids)
        for request_id in request_ids:
            self._matches.pop(request_id, None)
        self.drafter.forget(request_ids)
