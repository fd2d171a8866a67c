"""Draft lengths: k follows acceptance and the measured cost of extra rows."""

from __future__ import annotations

import pytest

from memwall.spec_decode.adaptive import (PROBE_AFTER, DraftLengths, DraftRowPrice, LearnedStepCost,
                                          StepCost, expected_tokens)


def test_step_cost_interpolates_and_extrapolates():
    cost = StepCost({1: 1.0, 2: 1.5, 4: 2.0})
    assert cost(1) == 1.0 and cost(2) == 1.5 and cost(4) == 2.0
    assert cost(3) == pytest.approx(1.75)
    assert cost(6) == pytest.approx(2.5)  # the last slope (0.25 a row) goes on
    assert StepCost({2: 2.0})(1) == pytest.approx(1.0)


def test_a_step_of_more_rows_is_never_priced_below_one_of_fewer():
    """A start-up whose first timing was slow (1 row 7.25 ms, 4 rows 6.49): the smaller counts
    take the larger one's figure, so an extra row is not priced at a third of a step."""
    cost = StepCost({1: 7.25, 2: 8.28, 3: 9.34, 4: 6.49, 5: 7.3})
    assert [cost(n) for n in (1, 2, 3, 4, 5)] == [6.49, 6.49, 6.49, 6.49, 7.3]
    lengths = DraftLengths(4, StepCost({1: 7.25, 2: 8.28, 3: 9.34, 4: 6.49, 5: 7.3}))
    assert lengths.choose("a", batch=1) > 0  # the prior's 60% pays for a nearly free row


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_cheap_rows_and_good_acceptance_draft_the_most():
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.35}))
    for _ in range(5):
        lengths.observe("a", 4, 4)
    assert lengths.choose("a", batch=1) == 4


def test_rejections_shrink_k_then_stop_drafting_then_retry_later():
    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 1.3, 5: 2.2}))
    assert lengths.choose("a", batch=1) > 0  # the prior is optimistic
    for _ in range(6):
        lengths.observe("a", 4, 0)
    assert lengths.rate("a") < 0.1
    assert lengths.choose("a", batch=1) == 0
    steps = 0
    while lengths.choose("a", batch=1) == 0:
        lengths.idle("a")
        steps += 1
        assert steps < 100
    assert steps > 3  # not at once: a sequence that failed waits a while


def test_expensive_rows_never_pay():
    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 2.0}))  # every row costs a full step
    for _ in range(5):
        lengths.observe("a", 4, 3)
    assert lengths.choose("a", batch=1) == 0


def test_big_batches_draft_less():
    # compute-bound from 8 rows: an extra row costs 1/8 of a step there
    lengths = DraftLengths(4, StepCost({1: 1.0, 4: 1.2, 8: 1.4, 64: 8.4}))
    for _ in range(3):
        lengths.observe("a", 4, 2)
    assert lengths.choose("a", batch=1) > lengths.choose("a", batch=32)


def test_sequences_of_one_step_price_the_rows_the_others_added():
    """Cheap rows up to 16 (the packed kernels), then a jump: alone, a sequence in a batch of
    12 drafts 4; once others filled the step past 16 rows, the next one drafts nothing."""
    cost = StepCost({1: 5.0, 12: 20.0, 16: 24.0, 17: 30.0, 32: 48.0})
    lengths = DraftLengths(4, cost)
    for rid in ("a", "b"):
        for _ in range(5):
            lengths.observe(rid, 4, 4)
    assert lengths.choose("a", batch=12) == 4
    assert lengths.choose("b", batch=12, drafted=4) == 0  # 16 rows already: the 17th costs 6
    assert lengths.choose("b", batch=12, drafted=0) == 4


def test_measured_drafting_time_outweighs_a_cheap_start_up_figure():
    """The start-up timing says a drafted token costs 0.1 of a step; the proposer's measured
    wall time says 0.5: the sequence stops drafting at a rate that paid under the first."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.2}), draft_cost=StepCost({1: 0.1}))
    for _ in range(5):
        lengths.observe("a", 2, 1)  # about 0.4 accepted
    assert lengths.choose("a", batch=1) > 0
    lengths.observe_drafting(seconds=1.5, tokens=3)
    assert lengths.drafting_s == 0.5
    assert lengths.choose("a", batch=1) == 0
    lengths.observe_drafting(seconds=0.0, tokens=0)  # nothing drafted: no change
    assert lengths.drafting_s == 0.5
    free = DraftLengths(4, StepCost({1: 1.0, 8: 1.2}))  # prompt lookup: no drafter to time
    free.observe_drafting(seconds=1.5, tokens=3)
    assert free.drafting_s is None


def test_a_drafting_time_that_stops_all_drafts_fades_back_towards_the_start_up_figure():
    """One slow proposer call (a drafter reading a whole prompt, timed by mistake) priced its
    drafts out; no drafting call comes to correct it, so steps without drafts bring the figure
    back towards the start-up one until the sequence drafts again, and it never goes below."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.2}), draft_cost=StepCost({1: 0.1}))
    for _ in range(5):
        lengths.observe("a", 2, 1)
    lengths.observe_drafting(seconds=4.0, tokens=4)  # 1.0 a token: a step's worth
    steps = 0
    while lengths.choose("a", batch=1) == 0:
        lengths.end_step(False)
        steps += 1
        assert steps < 100, lengths.drafting_s
    assert 5 < steps < 40 and 0.1 < lengths.drafting_s < 0.5
    for _ in range(200):
        lengths.end_step(False)
    assert lengths.drafting_s == pytest.approx(0.1)
    lengths.end_step(True)  # a step with drafts leaves it to the measurements
    assert lengths.drafting_s == pytest.approx(0.1)


def test_not_adaptive_always_drafts_k():
    lengths = DraftLengths(3, StepCost({1: 1.0, 2: 2.0}), adaptive=False)
    lengths.observe("a", 3, 0)
    assert lengths.choose("a", batch=16) == 3
    assert DraftLengths(2, None).choose("b", 1) == 2


def test_a_draft_models_own_steps_count_against_it():
    """Same verification cost and acceptance: a free drafter (prompt lookup) drafts 4, one
    whose step costs 0.4 of the target's drafts fewer, one costing 0.9 not at all."""
    target = StepCost({1: 1.0, 8: 1.35})
    choices = []
    for relative in (None, 0.4, 0.9):
        draft = StepCost({1: relative, 8: relative * 1.35}) if relative is not None else None
        lengths = DraftLengths(4, target, draft_cost=draft)
        for _ in range(5):
            lengths.observe("a", 4, 3)  # 75%
        choices.append(lengths.choose("a", batch=1))
    assert choices[0] == 4 and 0 < choices[1] < 4 and choices[2] == 0


def test_the_learned_cost_keeps_the_tables_shape_at_the_scale_of_the_steps_seen():
    startup = StepCost({1: 1.0, 4: 2.0, 8: 3.0, 16: 5.0, 17: 7.0})
    learned = LearnedStepCost(startup)
    assert learned(5) == startup(5)  # nothing seen yet
    for seconds in (2.8, 3.0, 3.2):  # steps of 4 rows: 1.5x the table
        learned.observe(4, seconds)
    assert learned(4) == pytest.approx(3.0)  # a plain mean of the first steps
    assert learned(1) == pytest.approx(1.5)  # one side seen: its ratio
    assert learned(17) == pytest.approx(7.0 * 1.5)  # the step past 16 rows stays a step
    learned.observe(16, 20.0)
    learned.observe(16, 20.0)
    assert learned(8) == pytest.approx(4.5)  # 16 rows seen twice: not enough to count yet
    learned.observe(16, 20.0)  # now 4x the table at 16
    assert learned(16) == pytest.approx(20.0)
    assert learned(8) == pytest.approx(3.0 * (1.5 + (4.0 - 1.5) * 4 / 12))  # ratio interpolated
    assert learned(17) == pytest.approx(7.0 * 4.0)
    assert learned.samples(16) == 3 and learned.samples(5) == 0


def test_one_slow_step_moves_the_learned_cost_a_little():
    learned = LearnedStepCost(StepCost({1: 1.0, 8: 2.0}))
    for _ in range(30):
        learned.observe(2, 1.0)
    learned.observe(2, 100.0)  # the OS took the core for a while
    assert 1.0 < learned(2) <= 1.0 + LearnedStepCost.ALPHA * (LearnedStepCost.CLAMP - 1.0)
    learned.observe(0, 1.0)  # nonsense is ignored
    learned.observe(3, -1.0)
    assert learned.samples(0) == learned.samples(3) == 0


def test_real_steps_that_cost_more_than_the_table_stop_the_drafting_it_promised():
    """The start-up table says extra rows are nearly free; the steps run say each row costs
    as much as a whole one-row step: a sequence accepted half the time stops drafting."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.35}))
    for _ in range(5):
        lengths.observe("a", 4, 1)
    assert lengths.choose("a", batch=4) > 0
    for rows in range(1, 9):
        for _ in range(LearnedStepCost.MIN_SAMPLES):
            lengths.observe_step(rows, 1.0 * rows)
    assert lengths.choose("a", batch=4) == 0
    assert lengths.choose("a", batch=1) == 0


def test_a_row_count_priced_out_by_the_table_alone_is_tried_until_timed():
    """The start-up table prices an extra row at a whole step: nobody drafts, so no step of 2
    rows would ever be timed to correct it. After PROBE_AFTER quiet steps one draft is tried,
    until MIN_SAMPLES steps of 2 rows were timed; then the learned cost decides: where they
    are nearly free the sequence drafts on its own, where they cost what the table said it
    stops, and the probes stop too."""
    def run(two_rows_s: float, steps: int) -> list[int]:
        lengths = DraftLengths(4, StepCost({1: 1.0, 2: 2.0, 8: 8.0}))
        for _ in range(5):
            lengths.observe("a", 2, 1)  # half accepted
        chosen = []
        for _ in range(steps):
            k = lengths.choose("a", batch=1)
            chosen.append(k)
            lengths.end_step(k > 0)
            if k == 0:
                lengths.observe_step(1, 1.0)
            else:
                lengths.observe_step(1 + k, two_rows_s + (k - 1))
        return chosen

    cheap = run(1.05, 6 * PROBE_AFTER)
    assert cheap.index(1) == PROBE_AFTER  # not before
    third = [i for i, k in enumerate(cheap) if k][2]
    assert third == 3 * PROBE_AFTER + 2  # three probes, PROBE_AFTER quiet steps apart
    assert all(cheap[third + 1:])  # 2 rows timed at 1.05: drafting pays, every step

    dear = run(2.0, 12 * PROBE_AFTER)
    assert sum(k > 0 for k in dear) == LearnedStepCost.MIN_SAMPLES  # probes, then no more


def test_a_learned_row_count_dearer_than_the_next_does_not_make_drafts_free():
    """One-row steps seen cold (after prefills) average above the two-row steps: an extra row
    would come out below zero, and a sequence whose drafts are never accepted would draft on
    (its 0 tokens still beat a negative price). Priced at no less than nothing, it stops."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 1.1, 8: 1.8}))
    for _ in range(LearnedStepCost.MIN_SAMPLES):
        lengths.observe_step(1, 1.3)
        lengths.observe_step(2, 1.0)
    assert lengths.cost(2) < lengths.cost(1)
    for _ in range(20):
        lengths.observe("a", 2, 0)  # nothing accepted
    assert lengths.choose("a", batch=1) == 0


def test_free_drafts_keep_an_estimate_of_their_own_and_no_drafting_price():
    """lookup_first: one sequence's lookup drafts are accepted, its drafter's rejected. Priced
    as free (``choose(free=True)``) it drafts on the lookup's record at no drafting time; priced
    as the drafter's, on the drafter's record and its time: none."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.2}), draft_cost=StepCost({1: 0.3}))
    for _ in range(6):
        assert lengths.choose("a", batch=1, free=True) > 0
        lengths.observe("a", 4, 4)  # the lookup's drafts: all accepted
        lengths.choose("a", batch=1, free=False)
        lengths.observe("a", 2, 0)  # the drafter's: none
    assert lengths.rate("a", free=True) > 0.9 > 0.2 > lengths.rate("a", free=False)
    assert lengths.choose("a", batch=1, free=True) == 4
    assert lengths.choose("a", batch=1, free=False) == 0
    assert lengths.knows("a")
    lengths.forget(["a"])
    assert not lengths.knows("a") and lengths.rate("a", free=True) == lengths.rate("b")


def test_a_lookup_match_takes_the_drafters_drafts_where_they_gain_more():
    """lookup_first: a sequence whose lookup drafts keep failing but whose draft model's are
    accepted drafts from the model even where lookup has a match (``choose_among``), and
    from lookup where that gains more; the verification's outcome goes to the estimate of
    the kind that drafted."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 8: 1.2}), draft_cost=StepCost({1: 0.05}))
    for _ in range(6):
        lengths.choose_among("a", 1, 0, (True,))
        lengths.observe("a", 4, 0)  # lookup's drafts: none accepted
        lengths.choose_among("a", 1, 0, (False,))
        lengths.observe("a", 4, 4)  # the model's: all
    assert lengths.choose_among("a", 1, 0, (True,))[0] == 0  # lookup alone: not worth a row
    k, free = lengths.choose_among("a", 1, 0, (True, False))
    assert k == 4 and free is False
    lengths.observe("a", 4, 4)  # counted for the model's drafts, the kind last chosen
    assert lengths.rate("a", free=False) > 0.9 > 0.1 > lengths.rate("a", free=True)
    # the other way round: free lookup drafts, all accepted, win over a paid model
    for _ in range(12):
        lengths.choose_among("b", 1, 0, (True,))
        lengths.observe("b", 4, 4)
        lengths.choose_among("b", 1, 0, (False,))
        lengths.observe("b", 4, 2)
    assert lengths.choose_among("b", 1, 0, (True, False)) == (4, True)


def test_could_draft_says_no_only_where_no_sequence_of_the_step_would_draft():
    """The runner skips pricing a step's sequences when ``could_draft`` says none would. At
    every batch size and estimate, its no means that a sequence at or below that estimate
    drafts nothing of either kind; where rows are nearly free it says yes; a due probe is a
    yes whatever the price."""
    cost = StepCost({1: 1.0, 4: 1.3, 16: 4.0, 24: 6.0})  # rows cheap up to 4, then a quarter each
    lengths = DraftLengths(4, cost, draft_cost=StepCost({1: 0.05, 16: 0.4}))
    answers = set()
    for accepted in range(5):  # estimates from ~0.1 to ~0.97, for lookup's drafts and a model's
        for request_id, free in (("lookup", True), ("model", False)):
            lengths.forget([request_id])
            for _ in range(8):
                lengths.choose(request_id, batch=1, free=free)
                lengths.observe(request_id, 4, accepted)
            rate = lengths.rate(request_id, free)
            for batch in range(1, 25):
                could = lengths.could_draft(batch, rate)
                answers.add(could)
                if not could:
                    assert lengths.choose(request_id, batch, 0, free) == 0, (rate, batch)
    assert answers == {True, False}
    assert lengths.could_draft(1, 0.6) and not lengths.could_draft(16, 1.0)
    for _ in range(PROBE_AFTER):
        lengths.end_step(False)
    assert lengths.could_draft(16, 0.0)  # 17 rows were never timed: a probe is due
    assert DraftLengths(4, cost, adaptive=False).could_draft(16, 0.0)  # k drafts every step


def test_a_probe_is_the_only_draft_of_its_step():
    """16 sequences whose rows are priced out; the start-up table steps up at 17 rows and is
    cheap past it. After PROBE_AFTER quiet steps the first sequence probes one row, and the
    others, which would price their drafts past that step up, draft nothing; the next step
    prices as before."""
    cost = StepCost({1: 1.0, 16: 4.0, 17: 5.0, 48: 6.0})
    lengths = DraftLengths(4, cost)
    for _ in range(PROBE_AFTER):
        lengths.end_step(False)
    chosen, drafted = [], 0
    for i in range(16):
        k = lengths.choose(f"s{i}", batch=16, drafted=drafted, free=True)
        chosen.append(k)
        drafted += k
    assert chosen == [1] + [0] * 15
    assert lengths.choose("s1", batch=16, drafted=1, free=True) == 0
    lengths.end_step(True)
    # past the step up a row is nearly free: a sequence that chooses there still drafts
    assert lengths.choose("s1", batch=16, drafted=1, free=True) > 0


def test_counts_past_the_seen_ones_cost_at_least_the_seen_slope():
    """The start-up table is flat past 16 rows (matmuls only); the steps seen cost 3 ms a
    row up to 16. A 20-row step is priced at the seen slope, not the table's, and a sequence
    accepted 80% of the time does not draft into it (at the table's slope it drafted 4); with a
    single count seen the table's shape stands."""
    table = StepCost({1: 10.0, 16: 25.0, 17: 26.0, 64: 30.0})
    learned = LearnedStepCost(table)
    for rows in range(8, 17):
        for _ in range(LearnedStepCost.MIN_SAMPLES):
            learned.observe(rows, 0.010 + 0.003 * rows)
    assert learned(20) == pytest.approx(0.058 + 4 * 0.003)
    assert learned(12) == pytest.approx(0.046)  # seen counts keep their own figure
    lengths = DraftLengths(4, table)
    lengths.cost = learned
    for _ in range(20):
        lengths.choose("a", batch=16, free=True)
        lengths.observe("a", 5, 4)
    assert lengths.rate("a", free=True) == pytest.approx(0.8, abs=0.02)
    assert lengths.choose("a", batch=16, free=True) == 0
    alone = LearnedStepCost(table)
    for _ in range(LearnedStepCost.MIN_SAMPLES):
        alone.observe(16, 0.050)
    assert alone(20) == pytest.approx(table(20) * 0.050 / 25.0)


def test_where_every_step_drafts_a_plain_step_is_timed_now_and_then():
    """A start-up table that times 16 rows as dear as 17 prices a sixteenth sequence's draft
    row at nothing, so every step drafts and no plain 16-row step is timed to say otherwise.
    After PROBE_AFTER steps with drafts, a step drafts nothing; once plain steps of 16 rows
    were timed (cheaper than 17), the free row is gone and so are the drafts."""
    lengths = DraftLengths(1, StepCost({1: 1.0, 16: 5.0, 17: 5.0, 32: 9.0}))
    chosen = []
    for _ in range(6 * PROBE_AFTER):
        k = lengths.choose("a", batch=16, free=True)
        chosen.append(k)
        lengths.end_step(k > 0)
        if k:
            lengths.observe("a", 1, 1)  # always accepted, and still not worth a 17th row
            lengths.observe_step(17, 0.0535)
        else:
            lengths.observe_step(16, 0.046)
    first = chosen.index(0)
    assert first == PROBE_AFTER and all(chosen[:first])
    plain = [i for i, k in enumerate(chosen) if k == 0]
    assert plain[:LearnedStepCost.MIN_SAMPLES] == [PROBE_AFTER * n + n - 1 for n in range(1, 4)]
    assert not any(chosen[plain[LearnedStepCost.MIN_SAMPLES - 1]:])


def _drifting_c16_steps(lengths: DraftLengths, batch: bool) -> None:
    """A c=16 run on a VM whose speed changes: plain 16-sequence steps cost 50 ms at speed 1,
    each draft row 3.2 ms more (a whole row's worth: drafts cannot pay). Plain steps run
    slow; the verify steps (16 sequences + 4 drafts) happen to fall in fast moments (0.6),
    among plain steps of those moments; a few 16-row steps of 11 sequences + 5 drafts are
    cheaper still (fewer contexts to attend)."""
    def step(rows: int, seqs: int, speed: float) -> None:
        seconds = speed * (50.0 + 3.2 * (rows - seqs) - 1.0 * (16 - seqs)) / 1e3
        lengths.observe_step(rows, seconds, seqs if batch else None)

    for _ in range(40):
        step(16, 16, 1.0)
    for _ in range(LearnedStepCost.MIN_SAMPLES):
        step(16, 11, 0.6)
    for _ in range(8):  # the machine sped up a moment ago
        step(16, 16, 0.6)
    for _ in range(6):
        for _ in range(3):
            step(16, 16, 0.6)
        step(20, 16, 0.6)
    for _ in range(20):
        step(16, 16, 1.0)


def test_draft_rows_are_priced_against_plain_steps_of_their_moment_and_batch():
    """Counted by rows alone, the 20-row steps (timed fast) come out cheaper than the 16-row
    ones (timed slow), and a sequence accepted 90% of the time drafts 4 for nothing; compared
    with the plain steps of the same moments and sequences, a draft row costs what it does."""
    table = StepCost({1: 10.0, 16: 30.0, 17: 32.0, 20: 36.0, 32: 48.0})

    def choice(batch: bool) -> int:
        lengths = DraftLengths(4, table)
        _drifting_c16_steps(lengths, batch)
        for _ in range(10):
            lengths.observe("a", 4, 4)  # a grounded sequence: 90%+ of its drafts accepted
        assert lengths.rate("a") > 0.85
        return lengths.choose("a", batch=16)

    assert choice(batch=False) == 4  # the failure: rows alone, drafting looks free
    assert choice(batch=True) == 0
    lengths = DraftLengths(4, table)
    _drifting_c16_steps(lengths, batch=True)
    # 4 draft rows cost 12.8 / 50 of a plain step, whatever the speed the steps ran at
    assert lengths.row_price.fraction(16, 20) == pytest.approx(1.0 + 12.8 / 50.0, rel=0.01)


def test_draft_rows_that_pay_still_draft_with_batches_known():
    """At batch 1 a draft row costs 10% of a step (as measured here): a sequence accepted 80%
    of the time keeps drafting, one accepted 5% stops."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 1.5, 5: 3.0}))
    for _ in range(5):
        lengths.observe_step(1, 0.010, 1)
        lengths.observe_step(5, 0.014, 1)
    assert lengths.row_price.knows(1)
    assert lengths.row_price.fraction(1, 5) == pytest.approx(1.4, rel=0.01)
    for _ in range(10):
        lengths.observe("good", 4, 3)
        lengths.observe("bad", 4, 0)
    assert lengths.choose("good", batch=1) >= 3
    assert lengths.choose("bad", batch=1) == 0


def test_a_draft_count_not_seen_is_priced_from_the_seen_ones_of_its_batch():
    price = DraftRowPrice()
    price.observe(4, 4, 0.010)
    price.observe(4, 6, 0.012)  # 2 drafts: 1.2 plain steps
    price.observe(4, 10, 0.020)  # 6 drafts: 2.0
    assert price.knows(4) and not price.knows(8)
    assert price.fraction(4, 4) == 1.0
    assert price.fraction(4, 5) == pytest.approx(1.1)  # between none and 2
    assert price.fraction(4, 8) == pytest.approx(1.6)  # between 2 and 6
    assert price.fraction(4, 12) == pytest.approx(2.0 + 2 * 1.0 / 6)  # their slope goes on
    price.observe(4, 4, 0.010)
    price.observe(4, 7, 0.0110)  # 3 drafts timed below 2: never priced below them
    assert price.fraction(4, 7) == pytest.approx(1.2)
    for _ in range(DraftRowPrice.REF_MAX_AGE):
        price.observe(8, 8, 0.015)  # other batches ran: 4 sequences' plain figure is old
    price.observe(4, 10, 0.040)  # nothing to compare it with
    assert price.fraction(4, 10) == pytest.approx(2.0)
    price.observe(2, 3, 0.005)  # a batch never seen plain: nothing learned
    assert not price.knows(2)


def test_one_slow_verify_step_cannot_price_drafting_out_for_good():
    """A verify step the OS interrupted moves its fraction a little; where a batch's fractions
    were not refreshed for STALE_STEPS steps, one draft is tried after PROBE_AFTER quiet steps,
    and its verify step makes them fresh again."""
    price = DraftRowPrice()
    for _ in range(4):
        price.observe(1, 1, 0.010)
        price.observe(1, 3, 0.014)
    assert price.fraction(1, 3) == pytest.approx(1.4)
    price.observe(1, 1, 0.010)
    price.observe(1, 3, 0.300)  # 30 plain steps' time
    # counted as at most CLAMP times the running fraction, with the running weight ALPHA
    assert price.fraction(1, 3) == pytest.approx(1.4 + DraftRowPrice.ALPHA * 1.4)
    price.observe(1, 1, 0.010)
    price.observe(1, 2, 0.010)  # a draft row timed free once
    price.observe(1, 1, 0.010)
    price.observe(1, 2, 0.013)
    assert price.fraction(1, 2) > 1.05  # a fraction at 1.0 still moves up

    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4}))
    for rows in range(1, 6):  # every row count timed: no probe of LearnedStepCost's is due
        for _ in range(LearnedStepCost.MIN_SAMPLES):
            lengths.cost.observe(rows, 0.010 + 0.002 * (rows - 1))
    lengths.row_price = price
    for _ in range(10):
        lengths.observe("a", 4, 0)  # nothing accepted: no draft pays
    chosen = []
    for _ in range(DraftRowPrice.STALE_STEPS + 2 * PROBE_AFTER):
        k = lengths.choose("a", batch=1)
        chosen.append(k)
        lengths.end_step(k > 0)
        lengths.observe_step(1 + k, 0.010 + 0.002 * k, 1)
    first = chosen.index(1)
    assert first > DraftRowPrice.STALE_STEPS and sum(chosen) == 1  # one probe, then fresh
    assert not price.stale(1)


def test_a_probe_replaces_a_stale_price_instead_of_nudging_it():
    """A fraction raised in a slow phase is refreshed only by the verify steps it prevents: the
    probe that comes once it is STALE_STEPS steps old sets it anew (nudged by ALPHA a probe, a
    doubled price took ~6 probes to come back). A fresh fraction still moves by ALPHA."""
    price = DraftRowPrice()
    for _ in range(4):  # a slow phase: one draft priced at 2.2 plain steps
        price.observe(1, 1, 0.010)
        price.observe(1, 2, 0.022)
    assert price.fraction(1, 2) == pytest.approx(2.2)
    price.observe(1, 1, 0.010)
    price.observe(1, 2, 0.011)  # fresh: moved a quarter of the way
    assert price.fraction(1, 2) == pytest.approx(2.2 + DraftRowPrice.ALPHA * (1.1 - 2.2))
    for _ in range(DraftRowPrice.STALE_STEPS):
        price.observe(1, 1, 0.010)  # no drafts for STALE_STEPS steps
    price.observe(1, 2, 0.011)  # the probe
    assert price.fraction(1, 2) == pytest.approx(1.1)
    price.observe(1, 1, 0.010)
    price.observe(1, 2, 0.015)  # fresh again: nudged
    assert price.fraction(1, 2) == pytest.approx(1.1 + DraftRowPrice.ALPHA * (1.5 - 1.1))


def test_a_first_step_of_a_draft_count_is_clamped_by_the_price_the_others_give_it():
    """One 2-draft step timed at 13 plain steps (a busy core) priced 2 drafts out for a run."""
    price = DraftRowPrice()
    price.observe(1, 1, 0.010)
    price.observe(1, 2, 0.011)  # one draft: 1.1
    predicted = price.fraction(1, 3)  # 2 drafts, from the slope of 1
    price.observe(1, 1, 0.010)
    price.observe(1, 3, 0.130)
    assert price.fraction(1, 3) == pytest.approx(predicted * DraftRowPrice.CLAMP)
    fresh = DraftRowPrice()
    fresh.observe(1, 1, 0.010)
    fresh.observe(1, 3, 0.130)  # nothing to compare with yet: taken as timed
    assert fresh.fraction(1, 3) == pytest.approx(13.0)


def test_an_old_price_of_one_draft_more_is_timed_again_once():
    """A sequence that drafts k drafts one more, once, where the price of k + 1 is older than
    STALE_STEPS steps: steps of k + 1 drafts are what would correct it, and the price keeps them
    from running."""
    lengths = DraftLengths(4, StepCost({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4}))
    price = lengths.row_price
    for _ in range(4):
        price.observe(1, 1, 0.010)
        price.observe(1, 2, 0.011)  # one draft: 1.1
    price.observe(1, 1, 0.010)
    price.observe(1, 3, 0.060)  # two drafts timed in a slow moment: 6 plain steps
    for _ in range(5):
        lengths.observe("a", 2, 1)  # about half accepted: one draft pays, two at 6x do not
    chosen = []
    for _ in range(DraftRowPrice.STALE_STEPS // 2 + 40):  # two steps each: STALE_STEPS + 80
        lengths.observe_step(1, 0.010, 1)  # another sequence's plain step: a fresh reference
        k = lengths.choose("a", batch=1)
        chosen.append(k)
        lengths.end_step(k > 0)
        lengths.observe_step(1 + k, 0.010 + 0.001 * k, 1)  # what they cost at full speed
    first = chosen.index(2)
    assert set(chosen[:first]) == {1}  # one draft pays; two, at their old price, do not
    assert 2 * first >= DraftRowPrice.STALE_STEPS  # tried once their price was old
    assert price.fraction(1, 3) == pytest.approx(1.2)  # timed anew: replaced, not nudged


def test_a_stale_count_is_retimed_once_even_where_its_step_goes_untimed():
    """Its step may not be timed (no plain step of late to compare it with): asking again at
    every step would draft one more at every step."""
    price = DraftRowPrice()
    price.observe(1, 1, 0.010)
    price.observe(1, 3, 0.020)  # two drafts timed once
    for _ in range(DraftRowPrice.STALE_STEPS + 1):
        price.observe(1, 1, 0.010)
    assert price.retime_due(1, 2)
    assert not price.retime_due(1, 2)  # the step it asked for was not timed: not again yet
    assert not price.retime_due(1, 1)  # never timed: nothing to retime
    for _ in range(DraftRowPrice.STALE_STEPS + 1):
        price.observe(1, 1, 0.010)
    assert price.retime_due(1, 2)  # STALE_STEPS later, once more
