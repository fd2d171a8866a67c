"""Start-up sizes (memwall/engine/sizing.py): with a calibration file the engine takes the step
budget and max sequences from the planner's roofline and times nothing; flags the user gave win;
without a file it measures as before."""

from __future__ import annotations

import json

import pytest

from memwall.engine import sizing
from memwall.entrypoints.llm import LLM
from memwall.planner.plan import make_plan
from memwall.planner.request import PlanRequest
from memwall.planner.serving import serve_sizes

from tests.planner.test_calibrate import CALIBRATION


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    return path


@pytest.fixture
def no_measuring(monkeypatch):
    def fail(*args):
        raise AssertionError("the step shape was measured although a calibration was given")

    monkeypatch.setattr("memwall.worker.worker.measure_step_shape", fail)


def test_engine_sizes_itself_from_the_calibration(tiny_model_dir, calibration, no_measuring):
    model = str(tiny_model_dir("llama"))
    llm = LLM(model, calibration=str(calibration), num_kv_blocks=40, max_model_len=128)
    config = llm.engine.core.scheduler.config
    plan = make_plan(PlanRequest(model=model, device="this", calibration=str(calibration),
                                 max_model_len=128, batch=1))
    expected = serve_sizes(plan.decode_model, plan.prefill_model, 40 * 16, 128, 16,
                           str(calibration))
    assert config.max_num_seqs == expected.max_num_seqs == 40 * 16 // 128
    assert config.max_num_batched_tokens == expected.max_num_batched_tokens
    assert f"from the calibration {calibration}" in llm.engine.describe()


def test_flags_win_over_the_calibration(tiny_model_dir, calibration, no_measuring):
    llm = LLM(str(tiny_model_dir("llama")), calibration=str(calibration), num_kv_blocks=40,
              max_model_len=128, max_num_seqs=3, max_num_batched_tokens=96)
    config = llm.engine.core.scheduler.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (3, 96)
    assert "from the calibration" not in llm.engine.describe()
    one = LLM(str(tiny_model_dir("llama")), calibration=str(calibration), num_kv_blocks=40,
              max_model_len=128, max_num_seqs=3)
    assert one.engine.core.scheduler.config.max_num_seqs == 3  # the budget is still sized
    assert "from the calibration" in one.engine.describe()


def test_calibration_paths(tmp_path, monkeypatch, calibration):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert sizing.calibration_path(None) is None and sizing.calibration_path("none") is None
    assert sizing.calibration_path("auto") is None  # no file at the default place: measure
    default = tmp_path / "home" / ".cache" / "memwall" / "calibration.json"
    default.parent.mkdir(parents=True)
    default.write_text(calibration.read_text())
    assert sizing.calibration_path("auto") == default
    assert sizing.calibration_path(str(calibration)) == calibration
    with pytest.raises(ValueError, match="does not exist: write it with `memwall plan"):
        sizing.calibration_path(str(tmp_path / "missing.json"))


def test_the_command_line_looks_for_the_default_calibration():
    import argparse

    from memwall.entrypoints.cli import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args([])).calibration == "auto"
    assert engine_args_from(parser.parse_args(["--calibration", "none"])).calibration == "none"
