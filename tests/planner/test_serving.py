"""The engine's start-up sizes from a calibration (memwall/planner/serving.py): the budget
policy of memwall/worker/step_shape.py fed with the roofline's predictions, max sequences from
the KV cache, and sizes the user gave kept as given."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memwall.planner.plan import make_plan
from memwall.planner.request import PlanRequest
from memwall.planner.roofline import decode_step, prefill_chunk_s
from memwall.planner.serving import (MAX_BUDGET, MIN_BUDGET, PREFILL_PROBE, choose_budget,
                                     kv_max_num_seqs, serve_sizes)

from tests.planner.test_calibrate import CALIBRATION


@pytest.fixture
def models(tmp_path, gguf_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    plan = make_plan(PlanRequest(device="this", calibration=str(path), max_model_len=2048))
    return plan.decode_model, plan.prefill_model


def test_sizes_are_the_formula(models) -> None:
    decode, prefill = models
    sizes = serve_sizes(decode, prefill, kv_tokens=20_000, max_model_len=2048, block_size=16,
                        source="cal.json")
    seqs = 20_000 // 2048  # full-context requests the KV cache holds
    # what step_shape.py times: the matmuls of the step alone (no host time, no attention)
    step_s = decode_step(replace(decode, host_s=0), seqs, 0).step_s
    rate = PREFILL_PROBE / prefill_chunk_s(
        replace(prefill, host_s=0, host_token_s=0, attention_flops_per_key=0), PREFILL_PROBE, 0,
        last=False)
    assert (sizes.max_num_seqs, sizes.decode_batch) == (9, 9)
    assert sizes.decode_step_s == pytest.approx(step_s)
    assert sizes.prefill_tokens_per_s == pytest.approx(rate)
    assert sizes.max_num_batched_tokens == choose_budget(step_s, rate, 9, 16)
    # by hand: 3 decode steps are under the 1 s floor, so the budget is one second of prefill
    assert 3 * step_s < 1.0
    assert sizes.max_num_batched_tokens == 9 + int(rate) // 16 * 16
    assert "from the calibration cal.json" in sizes.describe()


def test_explicit_sizes_win(models) -> None:
    decode, prefill = models
    sizes = serve_sizes(decode, prefill, 20_000, 2048, 16, "cal.json", max_num_seqs=3,
                        max_num_batched_tokens=96)
    assert (sizes.max_num_seqs, sizes.max_num_batched_tokens, sizes.decode_batch) == (3, 96, 3)
    only_seqs = serve_sizes(decode, prefill, 20_000, 2048, 16, "cal.json", max_num_seqs=40)
    assert only_seqs.decode_batch == 16  # the budget is sized for at most 16 decodes a step
    assert MIN_BUDGET <= only_seqs.max_num_batched_tokens <= MAX_BUDGET


@pytest.mark.parametrize("kv_tokens, max_len, expected", [
    (20_000, 2048, 9), (100, 2048, 1), (10**7, 128, 64)])
def test_max_num_seqs_from_the_kv_cache(kv_tokens, max_len, expected) -> None:
    assert kv_max_num_seqs(kv_tokens, max_len) == expected


def test_a_faster_machine_gets_a_larger_budget(tmp_path, gguf_path) -> None:
    budgets = []
    for scale in (1, 2):  # the 128-token probe chunk runs the integer kernels
        path = tmp_path / f"cal{scale}.json"
        flops = {**CALIBRATION["matmul_flops"],
                 "int8_prefill": CALIBRATION["matmul_flops"]["int8_prefill"] * scale}
        path.write_text(json.dumps({**CALIBRATION, "matmul_flops": flops}))
        plan = make_plan(PlanRequest(device="this", calibration=str(path), max_model_len=2048))
        budgets.append(serve_sizes(plan.decode_model, plan.prefill_model, 20_000, 2048, 16,
                                   str(path)).max_num_batched_tokens)
    assert budgets[1] > budgets[0]
