"""The step budget chosen from measured kernel speed (memwall/worker/step_shape.py)."""

from __future__ import annotations

import pytest

from memwall.config import DEFAULT_STEP_BUDGET
from memwall.entrypoints.llm import LLM
from memwall.worker import step_shape
from memwall.worker.step_shape import (MAX_BUDGET, MIN_BUDGET, MIN_PREFILL_SLICE_S,
                                       MIXED_STEP_FACTOR, choose_budget)


def test_budget_is_the_prefill_that_fits_beside_the_decodes():
    # 3 decode steps of 500 ms at 1000 tokens/s: 1500 tokens, in whole 16-token blocks -> 1488
    assert choose_budget(0.500, 1000.0, 16, 16) == 16 + 1488
    # fast decode steps: the one-second floor (1000 tokens -> 992)
    assert choose_budget(0.010, 1000.0, 16, 16) == 16 + 992
    assert (MIXED_STEP_FACTOR, MIN_PREFILL_SLICE_S) == (4.0, 1.0)  # the arithmetic above


def test_budget_follows_the_machine():
    slow = choose_budget(0.050, 300.0, 16, 16)
    fast = choose_budget(0.050, 2000.0, 16, 16)
    assert slow < fast  # faster prefill kernels: bigger chunks for the same latency


@pytest.mark.parametrize("decode_s, rate, expected", [
    (0.0001, 10.0, MIN_BUDGET),        # a slow machine still admits a few blocks a step
    (10.0, 1e6, MAX_BUDGET),           # never more than the default's 2048
])
def test_budget_is_clamped(decode_s, rate, expected):
    assert choose_budget(decode_s, rate, 16, 16) == expected


def test_engine_measures_and_reports_its_budget(tiny_model_dir, monkeypatch):
    seen = {}

    def fake_measure(model, max_num_seqs, block_size):
        seen["args"] = (max_num_seqs, block_size)
        return step_shape.StepShape(192, 8, 0.02, 1234.0)

    monkeypatch.setattr("memwall.worker.worker.measure_step_shape", fake_measure)
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", max_num_seqs=8, num_kv_blocks=64)
    assert seen["args"] == (8, 16)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == 192
    assert "step budget 192 tokens" in llm.engine.describe()
    assert "prefill 1234 tokens/s" in llm.engine.describe()


def test_a_budget_the_user_sets_is_not_measured(tiny_model_dir, monkeypatch):
    def fail(*_):
        raise AssertionError("measured although the user set the budget")

    monkeypatch.setattr("memwall.worker.worker.measure_step_shape", fail)
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", max_num_batched_tokens=96, num_kv_blocks=64)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == 96
    assert "step budget 96 tokens" in llm.engine.describe()


def test_without_chunked_prefill_the_default_budget_stays(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("memwall.worker.worker.measure_step_shape",
                        lambda *_: pytest.fail("a prompt must fit one step without chunking"))
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", enable_chunked_prefill=False, num_kv_blocks=64)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == DEFAULT_STEP_BUDGET


def test_real_measurement_on_a_tiny_model(tiny_model_dir):
    """The measurement runs the model's own projections: positive times, a budget in range
    reported at start-up, and generation works under it."""
    from memwall.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    budget = llm.engine.core.scheduler.config.max_num_batched_tokens
    assert MIN_BUDGET <= budget <= MAX_BUDGET
    assert f"step budget {budget} tokens (measured here: a 4-sequence decode step" in llm.engine.describe()
    out = llm.generate([[(3 + i) % 380 for i in range(300)]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_row_costs_are_timed_in_interleaved_rounds(monkeypatch):
    """Each round times every size in turn (a slow moment costs one timing of several sizes,
    not all of one size's), after one warm-up; each size keeps its fastest round."""
    order: list[int] = []
    times = iter([0.0] + [9.0, 2.0, 3.0, 1.0, 5.0, 3.5, 1.5, 2.5, 4.0])  # warm-up, then rounds

    def runner(model, projections, tokens, with_head):
        assert tokens == 4 and with_head

        def run(rows):
            order.append(rows)
            return next(times)
        return run

    monkeypatch.setattr(step_shape, "_projections", lambda model: [])
    monkeypatch.setattr(step_shape, "_pass_runner", runner)
    costs = step_shape.measure_row_costs(object(), (1, 2, 4))
    assert order == [4, 1, 2, 4, 1, 2, 4, 1, 2, 4]
    assert costs == {1: 1.0, 2: 2.0, 4: 3.0}
