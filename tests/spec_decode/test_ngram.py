"""Prompt-lookup drafting: which suffix matches, which occurrence, how many tokens."""

from __future__ import annotations

import numpy as np
import pytest

from memwall.spec_decode import DraftRequest, make_proposer
from memwall.config import SpeculativeConfig
from memwall.spec_decode.ngram import NgramProposer


def lookup(tokens, k=4, min_n=2, max_n=4):
    return NgramProposer(min_n, max_n).lookup(np.array(tokens, dtype=np.int64), k)


def test_drafts_what_followed_the_earlier_occurrence_of_the_suffix():
    assert lookup([1, 2, 3, 4, 5, 6, 9, 2, 3]) == [4, 5, 6, 9]


def test_longest_suffix_wins_over_a_later_shorter_match():
    # suffix [7, 2, 3] matches at 0 (-> 10, 11); the shorter [2, 3] also matches later (-> 20)
    tokens = [7, 2, 3, 10, 11, 2, 3, 20, 21, 7, 2, 3]
    assert lookup(tokens, k=2, max_n=3) == [10, 11]
    assert lookup(tokens, k=2, min_n=2, max_n=2) == [20, 21]  # latest [2, 3] match


def test_latest_occurrence_of_equal_length_matches():
    assert lookup([5, 6, 1, 5, 6, 2, 5, 6], k=1, max_n=2) == [2]


def test_draft_stops_at_the_end_of_the_known_tokens():
    # the match is right before the suffix: only the tokens between are known
    assert lookup([4, 4, 4], k=4, min_n=1, max_n=2) == [4]
    assert lookup([1, 2, 9, 1, 2], k=5) == [9, 1, 2]


@pytest.mark.parametrize("tokens", [[], [1], [1, 2], [1, 2, 3, 4, 5]])
def test_no_draft_without_a_match(tokens):
    assert lookup(tokens) == []


def test_k_zero_and_min_n_respected():
    assert lookup([1, 2, 3, 1, 2], k=0) == []
    assert lookup([1, 2, 3, 9, 2], k=3, min_n=2) == []  # only a 1-token suffix matches
    assert lookup([1, 2, 3, 9, 2], k=3, min_n=1) == [3, 9, 2]


def test_proposer_batch_skips_sequences_without_a_match():
    proposer = make_proposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2))
    out = proposer.propose([DraftRequest("a", np.array([1, 2, 3, 1, 2]), 2),
                            DraftRequest("b", np.array([1, 2, 3, 4]), 2)])
    assert out == {"a": [3, 1]}


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown speculative config key"):
        SpeculativeConfig.parse({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse('{"num_speculative_tokens": 0}')
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig(num_speculative_tokens=3)
    for key, value in (("num_speculative_tokens", 2.5), ("num_speculative_tokens", "3"),
                       ("num_speculative_tokens", True), ("prompt_lookup_min", 1.5),
                       ("prompt_lookup_max", None), ("disable_by_batch_size", 2.5),
                       ("adaptive", "no"), ("model", 7)):
        with pytest.raises(ValueError, match=key):  # one line naming the key, not a TypeError
            SpeculativeConfig.parse({"method": "ngram", key: value})
    assert SpeculativeConfig.parse({"disable_by_batch_size": 4, "adaptive": False}) == \
        SpeculativeConfig(disable_by_batch_size=4, adaptive=False)
