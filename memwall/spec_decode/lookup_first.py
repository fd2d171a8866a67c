"""Prompt lookup first, a drafter for the rest (speculative_config ``"lookup_first": true`` with
the draft_model or eagle method).

A chat reply restates its prompt and itself: in 20 ShareGPT chats, SmolLM2-135M's replies took
40% of their tokens from prompt-lookup verifications (2.7 tokens a verify, 60% of the drafts
accepted), where an EAGLE head drafting every token has 35-42% of its drafts accepted and pays
a small forward per drafted token. So a sequence whose last tokens recur earlier in it drafts
what followed there (ngram.py: free, often long), and the model drafts only for the sequences
with no match. Each draft is verified as any other, so the output is unchanged.

The drafter keeps following every sequence (an EAGLE head's features are recorded each step;
its cache catches up over the entries it skipped when the sequence next needs it), so a
sequence moves between the two from step to step.
"""

from __future__ import annotations

from memwall.spec_decode.ngram import NgramProposer
from memwall.spec_decode.proposer import DraftRequest, Proposer


class LookupFirstProposer(Proposer):
    def __init__(self, lookup: NgramProposer, drafter: Proposer) -> None:
        self.lookup, self.drafter = lookup, drafter
        self.wants_features = drafter.wants_features
        self._looked_up: set[str] = set()  # the last call's sequences drafted by lookup

    @property
    def drafting_model(self):
        """What one of the drafter's tokens runs (step_shape.measure_row_costs times it)."""
        return getattr(self.drafter, "drafting_model", None)

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = self.lookup.propose(requests)
        self._looked_up = set(drafts)
        rest = [r for r in requests if r.request_id not in drafts]
        if rest:
            drafts.update(self.drafter.propose(rest))
        return drafts

    def priced_tokens(self, drafts: dict[str, list[int]]) -> int:
        return sum(len(d) for rid, d in drafts.items() if rid not in self._looked_up)

    def record(self, request_id: str, start: int, features) -> None:
        self.drafter.record(request_id, start, features)

    def forget(self, request_ids: list[str]) -> None:
        self.drafter.forget(request_ids)
