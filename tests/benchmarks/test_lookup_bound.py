"""lookup_bound.py's replay steps as greedy verification does: accepted drafts plus one token a
step, rejected drafts still paid for, and its bounds never below the policies they bound."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks.lookup_bound import (best_copy_drafter, exact_lookup_drafter,  # noqa: E402
                                     lookup_drafter, replay, row_cost_from)

# the output restates the prompt's 10..19 after one token of its own, then ends with 2 new ones
PROMPT = [1, 2, 3] + list(range(10, 20)) + [4]
OUTPUT = [7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 30, 31]


def test_a_drafter_that_never_matches_steps_one_token_at_a_time():
    r = replay("none", lambda context, rest: [], [(PROMPT, OUTPUT)])
    assert (r.tokens, r.steps, r.drafted_steps) == (12, 12, 0)
    assert r.draft_rows == [12]
    assert r.speedup(lambda d: 1.0 + 0.5 * d) == pytest.approx(1.0)


def test_wrong_drafts_cost_rows_and_yield_nothing():
    r = replay("wrong", lambda context, rest: [99, 98], [(PROMPT, OUTPUT)])
    assert (r.tokens, r.steps, r.drafted_steps) == (12, 12, 11)
    # the last step has one token left: a draft would be past the output, so it has none
    assert r.draft_rows == [1, 1, 10]
    assert r.speedup(lambda d: 1.0 + 0.5 * d) == pytest.approx(12 / (1 + 1.5 + 10 * 2.0))


def test_lookup_replay_accepts_what_the_prompt_predicts():
    # after 7 the context ends "4 7": no match; then 10 matches the prompt's 10 (n = 1 only)
    one = replay("k=4", lookup_drafter(1, 4, 4), [(PROMPT, OUTPUT)])
    two = replay("k=4", lookup_drafter(2, 4, 4), [(PROMPT, OUTPUT)])
    assert one.tokens == two.tokens == 12
    # min 1: step 1 yields 10 alone (no match for "7"), step 2 drafts 11..14 (all accepted, +15),
    # step 3 16..19 (+30: the prompt's 4 drafted after 19 is not), step 4 31
    assert one.steps == 4 and one.draft_rows == [2, 0, 0, 0, 2]
    # min 2: "7 10" never occurs earlier; "10 11" does once 11 is out
    assert two.steps > one.steps
    assert one.tokens_per_step == pytest.approx(3.0)


def test_the_bounds_are_never_below_the_policy_they_bound():
    pairs = [(PROMPT, OUTPUT), ([5, 6, 5, 6, 5], [6, 5, 6, 8, 5, 6, 5])]
    cost = lambda d: 1.0 + 0.2 * d  # noqa: E731
    fixed = replay("k=4", lookup_drafter(1, 4, 4), pairs)
    exact = replay("best k", exact_lookup_drafter(1, 4, 4), pairs)
    copy = replay("best copy", best_copy_drafter(4), pairs)
    assert exact.tokens_per_step == pytest.approx(fixed.tokens_per_step)
    assert exact.speedup(cost) >= fixed.speedup(cost)
    assert copy.tokens_per_step >= fixed.tokens_per_step
    assert sum(exact.draft_rows[1:]) <= sum(fixed.draft_rows[1:])


def test_row_costs_interpolate_and_extend_the_measured_steps():
    cost = row_cost_from({1: 10.0, 3: 14.0, 5: 16.0})
    assert cost(0) == 1.0
    assert cost(1) == pytest.approx(1.2)  # 2 rows: between 1 and 3
    assert cost(4) == pytest.approx(1.6)
    assert cost(6) == pytest.approx(1.8)  # past the last: 5's slope of 1 ms a row
    with pytest.raises(ValueError):
        row_cost_from({1: 10.0})
