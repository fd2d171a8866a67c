"""The engine's start-up sizes on the CPU: the step's token budget and the most sequences that run
at once, where the user set neither (--max-num-batched-tokens, --max-num-seqs).

One policy, two sources of speed. Without a calibration file the engine times its own kernels at
start-up (memwall/worker/step_shape.py); with one (``memwall plan --device this --calibrate``)
the planner's roofline predicts the same two figures for the loaded model, in milliseconds and
without touching the model:

    decode_s      B = min(max_num_seqs, MAX_DECODE_PROBE) tokens through every projection and
                  the LM head (roofline.decode_step at context 0, without the host time)
    prefill       tokens/s of PREFILL_PROBE tokens through the projections (roofline.
                  prefill_chunk_s without attention or host time)
                  -- the two quantities step_shape.py times, so that a calibrated engine picks
                  the budget a measuring one would, from the same policy
    budget        B + the prefill tokens that fit in max((MIXED_STEP_FACTOR - 1) decode steps,
                  MIN_PREFILL_SLICE_S): a step that carries a prefill chunk keeps the running
                  sequences' inter-token latency within MIXED_STEP_FACTOR decode steps (or the
                  slice's floor); in whole KV blocks, within [MIN_BUDGET, MAX_BUDGET]
    max_num_seqs  the requests at full context (max_model_len) that the engine's KV cache holds
                  (its blocks x block size / max_model_len), at least 1 and at most
                  DEFAULT_MAX_NUM_SEQS: more would be preempted before they finish

Why the budget policy is what it is (measured on a 2-core EPYC): memwall/worker/step_shape.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memwall.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_STEP_BUDGET
from memwall.planner.roofline import StepModel, decode_step, prefill_chunk_s

MAX_BUDGET = DEFAULT_STEP_BUDGET  # the most a chosen budget may be
MIN_BUDGET = 64
MIXED_STEP_FACTOR = 4.0  # a step with a prefill chunk may cost this many decode-only steps
MIN_PREFILL_SLICE_S = 1.0  # ... or this long, whichever is more (see step_shape.py)
PREFILL_PROBE = 128  # tokens of the prefill chunk whose speed sets the budget
MAX_DECODE_PROBE = 16  # decode batch the budget is sized for (max_num_seqs when smaller)


def choose_budget(decode_step_s: float, prefill_tokens_per_s: float, decode_batch: int,
                  block_size: int) -> int:
    """decode_batch + the prefill tokens that fit in max((MIXED_STEP_FACTOR - 1) decode steps,
    MIN_PREFILL_SLICE_S), rounded down to whole blocks, within [MIN_BUDGET, MAX_BUDGET]."""
    slice_s = max((MIXED_STEP_FACTOR - 1.0) * decode_step_s, MIN_PREFILL_SLICE_S)
    chunk = prefill_tokens_per_s * slice_s
    chunk = int(chunk) // block_size * block_size
    return max(MIN_BUDGET, min(MAX_BUDGET, decode_batch + chunk))


def kv_max_num_seqs(kv_tokens: int, max_model_len: int) -> int:
    """Requests at full context the KV cache holds, within [1, DEFAULT_MAX_NUM_SEQS]."""
    return max(1, min(DEFAULT_MAX_NUM_SEQS, kv_tokens // max(1, max_model_len)))


@dataclass(frozen=True)
class ServeSizes:
    max_num_batched_tokens: int
    max_num_seqs: int
    decode_batch: int
    decode_step_s: float
    prefill_tokens_per_s: float
    source: str
    """Where the speeds came from (the calibration file)."""

    def describe(self) -> str:
        return (f"step budget {self.max_num_batched_tokens} tokens, max {self.max_num_seqs} "
                f"sequences (from the calibration {self.source}: a {self.decode_batch}-sequence "
                f"decode step {self.decode_step_s * 1e3:.1f} ms, prefill "
                f"{self.prefill_tokens_per_s:.0f} tokens/s predicted)")


def serve_sizes(decode: StepModel, prefill: StepModel, kv_tokens: int, max_model_len: int,
                block_size: int, source: str, max_num_seqs: int | None = None,
                max_num_batched_tokens: int | None = None) -> ServeSizes:
    """The sizes (module docstring) for a model the roofline describes (``decode``,
    ``prefill``: plan.Plan's step models); a size the user gave is kept as given."""
    seqs = max_num_seqs or kv_max_num_seqs(kv_tokens, max_model_len)
    batch = max(1, min(seqs, MAX_DECODE_PROBE))
    step_s, rate = probe_speeds(decode, prefill, batch)
    budget = max_num_batched_tokens or choose_budget(step_s, rate, batch, block_size)
    return ServeSizes(budget, seqs, batch, step_s, rate, source)


def probe_speeds(decode: StepModel, prefill: StepModel, batch: int) -> tuple[float, float]:
    """(seconds of a ``batch``-token decode step, prefill tokens/s) as step_shape.py measures
    them: the matmuls alone."""
    bare = replace(decode, host_s=0.0)
    step_s = decode_step(bare, batch, 0).step_s
    bare = replace(prefill, host_s=0.0, host_token_s=0.0, attention_flops_per_key=0.0)
    return step_s, PREFILL_PROBE / prefill_chunk_s(bare, PREFILL_PROBE, 0, last=False)
