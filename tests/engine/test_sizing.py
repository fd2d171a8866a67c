"""Start-up sizes (memwall/engine/sizing.py): with a calibration file the engine takes the step
budget and max sequences from the planner's roofline and times nothing; flags the user gave win;
without a file it measures as before."""

from __future__ import annotations

import json
import logging

import pytest

from memwall.engine import sizing
from memwall.entrypoints.llm import LLM
from memwall.planner.plan import make_plan
from memwall.planner.request import PlanRequest
from memwall.planner.serving import serve_sizes

from tests.planner.test_calibrate import CALIBRATION


def write_calibration(path, **changes):
    """CALIBRATION as if measured here (this CPU, the engine's thread count), with changes."""
    from memwall.planner.hardware import cpu_features, cpu_name
    from memwall.worker.worker import default_threads

    path.write_text(json.dumps({**CALIBRATION, "cpu": cpu_name(), "cpu_flags": cpu_features(),
                                "threads": default_threads(), **changes}))
    return path


@pytest.fixture
def calibration(tmp_path):
    return write_calibration(tmp_path / "calibration.json")


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


@pytest.mark.parametrize("changes", [{"cpu": "Another CPU 9000"}, {"threads": 64},
                                     {"cpu_flags": ["avx512f", "amx_tile"]}])
def test_a_calibration_from_another_machine_is_not_used(tiny_model_dir, tmp_path, caplog,
                                                        monkeypatch, changes):
    """A VM moved to another host (or an engine on other cores) keeps the file: its figures
    would size the steps wrongly, so the engine times its kernels as without one."""
    from memwall.worker.step_shape import StepShape

    path = write_calibration(tmp_path / "calibration.json", **changes)
    measured = StepShape(80, 16, 0.01, 500.0)
    monkeypatch.setattr("memwall.worker.worker.measure_step_shape", lambda *a: measured)
    # memwall's logger writes to stderr and does not propagate (memwall/__init__.py): let it
    # reach caplog's root handler whatever ran before (under pytest-xdist's order it did not)
    monkeypatch.setattr(logging.getLogger("memwall"), "propagate", True)
    monkeypatch.setattr(logging.getLogger("memwall"), "disabled", False)
    with caplog.at_level("WARNING", logger="memwall"):
        llm = LLM(str(tiny_model_dir("llama")), calibration=str(path), num_kv_blocks=40,
                  max_model_len=128)
    assert "not used" in caplog.text and "rerun memwall plan --device this --calibrate" in caplog.text
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == 80
    assert "from the calibration" not in llm.engine.describe()


def test_the_plan_notes_a_calibration_from_another_cpu(tmp_path, gguf_path) -> None:
    path = write_calibration(tmp_path / "calibration.json", cpu="Another CPU 9000")
    plan = make_plan(PlanRequest(model=str(gguf_path), device="this", calibration=str(path)))
    assert any("'Another CPU 9000'" in note and "--calibrate" in note for note in plan.notes)
    here = make_plan(PlanRequest(model=str(gguf_path), device="this",
                                 calibration=str(write_calibration(tmp_path / "here.json"))))
    assert not any("may not fit" in note for note in here.notes)
