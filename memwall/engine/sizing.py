"""The step budget and max sequences an engine starts with, where the user gave neither flag.

    a calibration file (EngineArgs.calibration; ``auto``, the command line's default, is
    ~/.cache/memwall/calibration.json when it exists) and the CPU
        -> the planner's roofline for the loaded model predicts a decode step and a prefill
           chunk (memwall/planner/serving.py): no kernel is timed, and the sizes do not move
           with whatever else the machine runs while the engine starts
    otherwise
        -> the worker times its kernels at start-up (memwall/worker/step_shape.py) for the
           budget; max sequences stays 64

A flag the user gave always wins. ``StepSizes`` is what EngineCore applies and prints.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memwall.config import EngineArgs, SchedulerConfig

if TYPE_CHECKING:
    from memwall.executor.base import Executor
    from memwall.planner.serving import ServeSizes
    from memwall.worker.kv_cache import KVCachePlan
    from memwall.worker.worker import ModelInfo

logger = logging.getLogger("memwall")

DEFAULT_PREFILL_TOK_S = 1000.0
"""Prefill speed assumed where none was measured or predicted (what a KV block costs to redo)."""


@dataclass(frozen=True)
class StepSizes:
    sched: SchedulerConfig
    """The scheduler config with the chosen sizes."""
    text: str
    """For the start-up line: the budget, and where it came from."""
    prefill_tokens_per_s: float
    calibrated: bool = False
    """The sizes came from a calibration file (nothing is to be measured)."""


def calibration_path(value: str | None) -> Path | None:
    """The calibration file ``value`` names: None for none; ``auto``: the default file if it
    exists; else the path, which must exist."""
    if value is None or value == "none":
        return None
    from memwall.planner.hardware import DEFAULT_CALIBRATION

    if value == "auto":
        path = DEFAULT_CALIBRATION.expanduser()
        return path if path.is_file() else None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"calibration file {value!r} does not exist: write it with `memwall "
                         "plan --device this --calibrate`, or leave --calibration out")
    return path


def step_sizes(args: EngineArgs, model: "ModelInfo", kv: "KVCachePlan", max_model_len: int,
               sched: SchedulerConfig) -> "ServeSizes | None":
    """The sizes predicted from the calibration file, or None: no file, not the CPU, or both
    sizes given. The budget stays as configured without chunked prefill (a prompt must fit
    one step)."""
    path = calibration_path(args.calibration)
    if path is None or model.device != "cpu" or (args.max_num_seqs and args.max_num_batched_tokens):
        return None
    from memwall.planner.plan import make_plan
    from memwall.planner.request import PlanRequest
    from memwall.planner.serving import serve_sizes

    mismatch = _mismatch(path, args.threads)
    if mismatch:
        logger.warning("calibration %s not used: %s; timing the kernels at start-up instead "
                       "(rerun memwall plan --device this --calibrate)", path, mismatch)
        return None

    request = PlanRequest(model=args.model, dtype=args.dtype, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_model_len,
                          tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size, batch=1,
                          device="this", calibration=str(path))
    try:
        plan = make_plan(request, with_what_ifs=False)
    except ValueError as e:  # a model the planner cannot read: fall back to measuring
        logger.warning("calibration %s not used: %s", path, e)
        return None
    if plan.decode_model is None or plan.prefill_model is None:
        return None
    given = args.max_num_batched_tokens or (None if sched.enable_chunked_prefill
                                            else sched.max_num_batched_tokens)
    return serve_sizes(plan.decode_model, plan.prefill_model, kv.max_tokens, max_model_len,
                       kv.block_size, str(path), args.max_num_seqs, given)


def _mismatch(path: Path, threads: int | None) -> str | None:
    """Why the file's figures are not this engine's (planner/hardware.py), or None."""
    import json

    from memwall.planner.hardware import calibration_mismatch
    from memwall.worker.worker import default_threads

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"it cannot be read ({e})"
    return calibration_mismatch(data if isinstance(data, dict) else {},
                                threads or default_threads())


def choose(args: EngineArgs, model: "ModelInfo", kv: "KVCachePlan", max_model_len: int,
           sched: SchedulerConfig) -> StepSizes:
    """The scheduler config to run with (module docstring). Call before the executor's
    init_cache when a calibration may change max_num_seqs."""
    sized = step_sizes(args, model, kv, max_model_len, sched)
    if sized is not None:
        sched = dataclasses.replace(sched, max_num_batched_tokens=sized.max_num_batched_tokens,
                                    max_num_seqs=sized.max_num_seqs)
        return StepSizes(sched, sized.describe(), sized.prefill_tokens_per_s, calibrated=True)
    return StepSizes(sched, f"step budget {sched.max_num_batched_tokens} tokens",
                     DEFAULT_PREFILL_TOK_S)


def measure(args: EngineArgs, sizes: StepSizes, block_size: int,
            executor: "Executor") -> StepSizes:
    """Without a calibration: the budget from the kernels' speed measured now (after
    init_cache), where the user gave none and prefill is chunked."""
    sched = sizes.sched
    if (sizes.calibrated or args.max_num_batched_tokens is not None
            or not sched.enable_chunked_prefill):
        return sizes
    shape = executor.measure_step_shape(sched.max_num_seqs, block_size)
    if shape is None:
        return sizes
    sched = dataclasses.replace(sched, max_num_batched_tokens=shape.max_num_batched_tokens)
    return StepSizes(sched, shape.describe(), shape.prefill_tokens_per_s)
