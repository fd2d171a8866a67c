"""Prompt lookup first, a drafter for the rest (speculative_config "lookup_first"): a sequence
with a lookup match drafts its continuation, the others go to the drafter, only the drafter's
tokens are priced as drafting time, the drafter keeps following every sequence, and greedy
output equals plain decoding with both sources drafting in one batch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memwall import LLM, SamplingParams
from memwall.config import SpeculativeConfig
from memwall.spec_decode.lookup_first import LookupFirstProposer
from memwall.spec_decode.ngram import NgramProposer
from memwall.spec_decode.proposer import DraftRequest, Proposer


class Recorder(Proposer):
    """A drafter that drafts [7] * k and notes what it was asked and handed."""

    wants_features = True

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.recorded: list[tuple[str, int]] = []
        self.forgotten: list[str] = []

    def propose(self, requests):
        self.asked += [r.request_id for r in requests]
        return {r.request_id: [7] * r.max_drafts for r in requests}

    def record(self, request_id, start, features):
        self.recorded.append((request_id, start))

    def forget(self, request_ids):
        self.forgotten += request_ids


def test_matched_sequences_draft_by_lookup_the_others_by_the_drafter():
    drafter = Recorder()
    proposer = LookupFirstProposer(NgramProposer(2, 3), drafter)
    repeats = DraftRequest("repeats", np.array([1, 2, 3, 4, 5, 1, 2, 3]), 3)  # "2 3" recurs: 4 5 1
    fresh = DraftRequest("fresh", np.array([9, 8, 6, 5, 4]), 2)
    drafts = proposer.propose([repeats, fresh])
    assert drafts == {"repeats": [4, 5, 1], "fresh": [7, 7]}
    assert drafter.asked == ["fresh"]
    assert proposer.priced_tokens(drafts) == 0  # the drafter's first call on "fresh": untimed
    drafts = proposer.propose([repeats, fresh])
    assert proposer.priced_tokens(drafts) == 2  # the lookup's three were free
    assert proposer.wants_features
    proposer.record("repeats", 8, None)  # every sequence's features reach the drafter
    proposer.forget(["repeats"])
    assert drafter.recorded == [("repeats", 8)] and drafter.forgotten == ["repeats"]
    assert proposer.propose([repeats]) == {"repeats": [4, 5, 1]}
    assert proposer.priced_tokens({"repeats": [4, 5, 1]}) == 0


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "lookup_first": True}, "lookup_first"),
    ({"method": "eagle", "model": "head", "lookup_first": "yes"}, "lookup_first is true or false"),
])
def test_lookup_first_is_checked_in_the_config(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_lookup_first_is_on_by_default_for_drafters_and_can_be_turned_off():
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m"}).uses_lookup_first
    assert SpeculativeConfig.parse({"method": "eagle", "model": "h"}).uses_lookup_first
    assert not SpeculativeConfig.parse({"method": "draft_model", "model": "m",
                                        "lookup_first": False}).uses_lookup_first
    assert not SpeculativeConfig.parse({"method": "ngram"}).uses_lookup_first
    assert not SpeculativeConfig.parse({"method": "ngram", "lookup_first": False}).uses_lookup_first


def test_greedy_equals_plain_with_both_sources_drafting(target, noisy_draft, draft_sources):
    """A draft model with lookup first, prompts that repeat (lookup matches) beside random
    ones (the drafter's), in one batch and with preemption: the plain output, both sources
    drafted and got drafts accepted, and no block leaked."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    prompts += [[5 + i, 17, 33, 2 * i + 40] * 6 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(target), num_kv_blocks=256, block_size=4).generate(prompts, params)
    config = {"method": "draft_model", "model": str(noisy_draft), "num_speculative_tokens": 4,
              "adaptive": False, "lookup_first": True, "prompt_lookup_min": 1,
              "prompt_lookup_max": 2}  # one-token matches: the random model rarely repeats more
    llm = LLM(str(target), speculative_config=config, num_kv_blocks=60, block_size=4,
              max_num_seqs=6, max_num_batched_tokens=40)
    proposer = llm.engine.core.executor.worker.runner.proposer
    assert isinstance(proposer, LookupFirstProposer)
    seen = draft_sources(proposer)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    drafted = {kind: sum(n for _, source, n in seen if source == kind)
               for kind in ("lookup", "drafter")}
    assert drafted["lookup"] > 20 and drafted["drafter"] > 20, drafted
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.stats.spec_num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_a_drafters_catch_up_after_lookup_is_not_timed_as_drafting():
    """The drafter's first call on a sequence after lookup drafted for it (or ever) also
    reads what it skipped: that call is not a per-token figure (priced_tokens 0); a call on
    sequences the drafter also served at their previous proposal is."""
    proposer = LookupFirstProposer(NgramProposer(2, 3), Recorder())
    repeats = DraftRequest("a", np.array([1, 2, 3, 4, 5, 1, 2, 3]), 2)
    fresh = DraftRequest("a", np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 8]), 2)
    other = DraftRequest("b", np.array([6, 5, 4]), 2)
    assert proposer.priced_tokens(proposer.propose([other])) == 0  # b's first call
    assert proposer.priced_tokens(proposer.propose([other])) == 2
    assert proposer.priced_tokens(proposer.propose([repeats, other])) == 2  # a by lookup
    assert proposer.priced_tokens(proposer.propose([fresh, other])) == 0  # a comes to the drafter
    assert proposer.priced_tokens(proposer.propose([fresh, other])) == 4
    proposer.forget(["a"])
    assert proposer.priced_tokens(proposer.propose([fresh])) == 0  # as new again


def test_propose_routes_by_the_match_drafts_free_found_without_searching_again():
    """The runner asks drafts_free for each sequence, then proposes for the ones that chose to
    draft: the lookup runs once a sequence a step, and the drafts are the same as a fresh one's."""
    lookup = NgramProposer(2, 3)
    proposer = LookupFirstProposer(lookup, Recorder())
    searches = []
    match = lookup.match
    lookup.match = lambda tokens: searches.append(len(tokens)) or match(tokens)
    repeats = DraftRequest("repeats", np.array([1, 2, 3, 4, 5, 1, 2, 3]), 3)
    fresh = DraftRequest("fresh", np.array([9, 8, 6, 5, 4]), 2)
    assert proposer.drafts_free("repeats", repeats.token_ids)
    assert not proposer.drafts_free("fresh", fresh.token_ids)
    assert proposer.propose([repeats, fresh]) == {"repeats": [4, 5, 1], "fresh": [7, 7]}
    assert searches == [8, 5]
    longer = DraftRequest("repeats", np.array([1, 2, 3, 4, 5, 1, 2, 3, 4]), 2)
    assert proposer.propose([longer]) == {"repeats": [5, 1]}  # not asked first: searched
    assert searches == [8, 5, 9]


def test_a_request_can_send_a_matched_sequence_to_the_drafter():
    """DraftRequest.by_lookup: False sends a sequence with a lookup match to the drafter (its
    drafts priced as drafting time), True or None keeps the lookup's."""
    drafter = Recorder()
    proposer = LookupFirstProposer(NgramProposer(2, 3), drafter)
    tokens = np.array([1, 2, 3, 4, 5, 1, 2, 3])
    assert proposer.lookup_or_model
    assert proposer.drafts_free("a", tokens)
    assert proposer.propose([DraftRequest("a", tokens, 3, by_lookup=False)]) == {"a": [7, 7, 7]}
    assert drafter.asked == ["a"]
    assert proposer.drafts_free("a", tokens)
    drafts = proposer.propose([DraftRequest("a", tokens, 3, by_lookup=False)])
    assert proposer.priced_tokens(drafts) == 3  # the drafter drafted it last time too: timed
    assert proposer.propose([DraftRequest("a", tokens, 3, by_lookup=True)]) == {"a": [4, 5, 1]}
    assert proposer.propose([DraftRequest("a", tokens, 3)]) == {"a": [4, 5, 1]}
    assert drafter.asked == ["a", "a"]
