"""spec_decode.py's concurrent rows: two engines stepped in turn compare the engines, not the
moments of a machine whose speed changes, where whole runs one after the other do not."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks.spec_decode import compare, one_at_a_time, run_interleaved  # noqa: E402


class Machine:
    """A clock whose work gets twice as slow once ``slow_after`` seconds have passed."""

    def __init__(self, slow_after: float) -> None:
        self.now, self.slow_after = 0.0, slow_after

    def __call__(self) -> float:
        return self.now

    def work(self, units: float) -> None:
        self.now += units * (2.0 if self.now >= self.slow_after else 1.0)


class FakeEngine:
    """Decodes ``tokens_per_step`` tokens a step for every request (all at once), each step
    ``step_work`` units of work on ``machine``; the metrics say how many came from drafts."""

    def __init__(self, machine: Machine, tokens_per_step: int, step_work: float) -> None:
        self.machine, self.tokens_per_step, self.step_work = machine, tokens_per_step, step_work
        self.requests: dict[str, list] = {}

    most_in_flight = 0

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.requests[request_id] = [params.max_tokens, []]
        self.most_in_flight = max(self.most_in_flight, len(self.requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list:
        self.machine.work(self.step_work)
        outs = []
        for request_id, (limit, tokens) in list(self.requests.items()):
            tokens.extend(range(len(tokens), min(limit, len(tokens) + self.tokens_per_step)))
            finished = len(tokens) >= limit
            if finished:
                del self.requests[request_id]
            extra = self.tokens_per_step - 1
            steps = -(-limit // self.tokens_per_step)
            outs.append(SimpleNamespace(
                request_id=request_id, finished=finished,
                outputs=[SimpleNamespace(token_ids=list(tokens))],
                metrics=SimpleNamespace(num_draft_tokens=extra * steps,
                                        num_accepted_tokens=extra * steps,
                                        num_verify_steps=steps if extra else 0)))
        return outs


def fake_llm(machine: Machine, tokens_per_step: int = 1, step_work: float = 1.0):
    return SimpleNamespace(engine=FakeEngine(machine, tokens_per_step, step_work),
                           render_chat=lambda messages: [1, 2, 3])


def test_engines_stepped_in_turn_see_the_same_moments_of_the_machine():
    """Both engines take as many steps (as at c=16, where few drafts pay), the speculative
    one's 0.8 of the plain one's work: 1.25x. The machine halves its speed partway through.
    Stepped in turn the ratio is exact, whichever goes first; one after the other, the engine
    that ran second ran on the slow machine."""
    for order in (("plain", "spec"), ("spec", "plain")):
        machine = Machine(slow_after=50.0)
        llms = {"plain": fake_llm(machine), "spec": fake_llm(machine, step_work=0.8)}
        r = run_interleaved({label: llms[label] for label in order}, ["a", "b", "c"], 64,
                            clock=machine)
        assert r["plain"]["tokens"] == r["spec"]["tokens"] == 3 * 64
        assert r["plain"]["outputs"] == r["spec"]["outputs"]
        assert r["spec"]["tok_s"] / r["plain"]["tok_s"] == pytest.approx(1.25)

    machine = Machine(slow_after=50.0)
    llms = {"plain": fake_llm(machine), "spec": fake_llm(machine, step_work=0.8)}

    apart = {label: run_interleaved({label: llm}, ["a", "b", "c"], 64, clock=machine)[label]
             for label, llm in llms.items()}  # whole runs, one engine after the other
    # spec ran second, on the slow machine: the faster engine came out slower
    assert apart["spec"]["tok_s"] / apart["plain"]["tok_s"] < 0.8


def test_drafted_tokens_are_counted_per_engine():
    machine = Machine(slow_after=1e9)
    r = run_interleaved({"plain": fake_llm(machine), "spec": fake_llm(machine, 2)}, ["a"], 64,
                        clock=machine)
    assert r["spec"]["draft_tokens"] == r["spec"]["accepted_tokens"] == 32
    assert r["spec"]["verify_steps"] == 32 and r["plain"]["verify_steps"] == 0
    assert r["spec"]["tok_s"] / r["plain"]["tok_s"] == pytest.approx(2.0)


def test_compare_takes_either_runner_and_reports_the_median_ratio():
    machine = Machine(slow_after=1e9)  # steady
    plain, spec = fake_llm(machine, 1), fake_llm(machine, 4)
    row = compare("c=2", plain, spec, lambda e, p, m: run_interleaved(e, p, m, clock=machine),
                  ["a", "b"], 32, runs=3)
    assert row["speedup"] == pytest.approx(4.0)
    assert len(row["plain_runs"]) == len(row["spec_runs"]) == 3
    assert row["greedy_agreement"] == 1.0
    assert row["mean_accepted_length"] == pytest.approx(4.0)


def test_one_at_a_time_keeps_one_request_in_flight_and_times_the_decode_phase():
    """Batch-1 rows: each engine takes the prompts one after another, and the decode phase is
    the time of each request's steps after the one that gave its first token."""
    machine = Machine(slow_after=1e9)
    llms = {"plain": fake_llm(machine), "spec": fake_llm(machine, 2, step_work=1.5)}
    r = one_at_a_time(llms, ["a", "b", "c"], 9, clock=machine)
    assert all(llm.engine.most_in_flight == 1 for llm in llms.values())
    assert r["plain"]["tokens"] == r["spec"]["tokens"] == 27
    # plain: 9 steps a request, the first gives token 1: 8 decode steps for 8 tokens
    assert r["plain"]["decode_tok_s"] == pytest.approx(1.0) and r["plain"]["seconds"] == 27.0
    # spec: 2 tokens a step, 5 steps a request (the last gives 1): 4 decode steps of 1.5
    assert r["spec"]["decode_tok_s"] == pytest.approx(8 / 6.0)
    both = run_interleaved(llms, ["a", "b", "c"], 9, clock=machine)  # all at once: no decode-phase figure
    assert both["plain"]["decode_tok_s"] is None
