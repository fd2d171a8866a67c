"""batch_scaling.py's closed loop: never more than c requests in flight, a new one as soon as one
finishes, and steps with a prompt in them kept apart from decode steps (whose rows give the
decode-only throughput)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks.batch_scaling import closed_loop  # noqa: E402


class FakeEngine:
    """One token a step for every request in flight; a request's first step is its prefill."""

    def __init__(self) -> None:
        self.requests: dict[str, list] = {}
        self.most_in_flight = 0
        self.steps = 0

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.requests[request_id] = [params.max_tokens, []]
        self.most_in_flight = max(self.most_in_flight, len(self.requests))

    def step(self) -> list:
        self.steps += 1
        outs = []
        for request_id, (limit, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            finished = len(tokens) >= limit
            if finished:
                del self.requests[request_id]
            outs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                        outputs=[SimpleNamespace(token_ids=list(tokens))]))
        return outs


class NoTimers:
    def start(self) -> None:
        pass

    def stop(self) -> list[float]:
        return []


def test_closed_loop_keeps_c_in_flight_and_counts_decode_rows_apart():
    engine = FakeEngine()
    llm = SimpleNamespace(engine=engine)
    prompts = [[1, 2, 3]] * 4
    result = closed_loop(llm, prompts, concurrency=2, max_tokens=3, tag="t", timers=NoTimers())
    assert engine.most_in_flight == 2
    # two rounds of (prefill step, two decode steps of 2 rows)
    assert engine.steps == 6
    assert result.decode_steps == 4 and result.decode_rows == 8
    assert result.output_tokens == 12 and result.requests == 4
    assert result.prefill_tokens == 12
    assert len(result.decode_step_ms) == 3


def test_uneven_lengths_refill_a_slot_as_soon_as_it_frees():
    engine = FakeEngine()
    llm = SimpleNamespace(engine=engine)
    result = closed_loop(llm, [[1]] * 3, concurrency=2, max_tokens=2, tag="u", timers=NoTimers())
    # step 1: prefill of 2; step 2: both decode and finish; step 3: the third's prefill;
    # step 4: its decode
    assert engine.steps == 4
    assert result.decode_steps == 2 and result.decode_rows == 3
    assert result.output_tokens == 6
