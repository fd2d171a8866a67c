"""Static batching's bubbles against continuous batching's measured slots, on a hand-made trace
whose answer is worked out in the comments."""

from __future__ import annotations

from memwall.core.batching_efficiency import compare, request_lengths, static_batches
from memwall.core.step_record import StepRecord


def step(index: int, *ran: tuple[str, int, int]) -> StepRecord:
    """ran: (request id, prefill tokens, new tokens); a step without prefill decodes 1 token."""
    ids = tuple(r[0] for r in ran)
    prefill = tuple(r[1] for r in ran)
    decode = tuple(0 if p else 1 for p in prefill)
    new = tuple(r[2] for r in ran)
    return StepRecord(index, 1000.0 + index, 0.01, ids, prefill, decode, new,
                      (0,) * len(ran), (0,) * len(ran))


# Four requests, two slots. a: 2 output tokens, b: 8, c: 4, d: 4.
#   step   0  1  2  3  4  5  6  7  8  9
#   a      P  D
#   b      P  D  D  D  D  D  D  D
#   c            P  D  D  D
#   d                        P  D  D  D
TRACE = [step(0, ("a", 5, 1), ("b", 3, 1)), step(1, ("a", 0, 1), ("b", 0, 1)),
         step(2, ("b", 0, 1), ("c", 4, 1)), step(3, ("b", 0, 1), ("c", 0, 1)),
         step(4, ("b", 0, 1), ("c", 0, 1)), step(5, ("b", 0, 1), ("c", 0, 1)),
         step(6, ("b", 0, 1), ("d", 6, 1)), step(7, ("b", 0, 1), ("d", 0, 1)),
         step(8, ("d", 0, 1)), step(9, ("d", 0, 1))]


def test_hand_made_trace():
    result = compare(TRACE)
    # continuous: 18 busy slot-steps of 2 slots x 10 steps
    assert (result.batch_size, result.continuous_busy, result.continuous_slots) == (2, 18, 20)
    assert result.continuous == 0.9
    # static, batches of 2 in order of arrival: (a, b) waits 8 steps for b, (c, d) 4 steps:
    # 2 * 8 + 2 * 4 = 24 slot-steps for 18 tokens, 6 of them bubbles (a idles 6 steps in batch 1)
    assert result.batch_lengths == ((2, 8), (4, 4))
    assert (result.static_busy, result.static_slots, result.static_idle) == (18, 24, 6)
    assert result.static == 0.75


def test_lengths_follow_first_appearance():
    lengths = request_lengths(TRACE)
    assert [(r.request_id, r.first_step, r.prompt_tokens, r.output_tokens) for r in lengths] == \
        [("a", 0, 5, 2), ("b", 0, 3, 8), ("c", 2, 4, 4), ("d", 6, 6, 4)]


def test_a_short_last_batch_and_an_empty_trace():
    assert static_batches([3, 1, 4, 1, 5], 2) == [(3, 1), (4, 1), (5,)]
    # the lone last request still holds a batch of 2 slots for 5 steps: 5 busy, 5 idle
    one = compare([step(0, ("x", 4, 1), ("y", 4, 1)), step(1, ("x", 0, 1)), step(2, ("x", 0, 1))])
    assert one.batch_lengths == ((3, 1),) and one.static_idle == 2 and one.continuous == 4 / 6
    empty = compare([])
    assert (empty.continuous, empty.static, empty.static_idle) == (0.0, 0.0, 0)


def test_a_prompt_without_output_yet_is_left_out_of_static():
    trace = [step(0, ("x", 16, 0), ("y", 2, 1)), step(1, ("x", 16, 1), ("y", 0, 1))]
    result = compare(trace)
    assert result.batch_lengths == ((1, 2),)  # x's two chunks, one token; y two tokens
    assert result.continuous_busy == 4 and result.static_slots == 4
