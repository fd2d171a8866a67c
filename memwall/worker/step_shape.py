"""The step's token budget, chosen from the kernels' measured speed on this machine (CPU).

Why: one engine step runs every scheduled token through the model together, so a prefill chunk
that joins running decodes makes each of them wait for it. With a fixed budget of 2048 tokens, a
burst of 16 short prompts was prefilled in one ~3 s step on a 2-core EPYC: every first token
waited for all of them, and every running sequence stalled for the whole step. A budget sized
so that a mixed step costs a few decode steps bounds the inter-token latency under prefill
pressure, and spreads a burst's prefills over steps so that the first prompts start answering
sooner (time to first token p50 about halves); the total work stays the same, because past a
few dozen tokens a matmul's cost per token hardly changes.

    decode_s    a decode step of ``decode_batch`` sequences (one token each) through every
                projection and the LM head
    prefill     tokens per second of a ``PREFILL_PROBE``-token chunk through the projections
    budget      decode_batch + the prefill tokens that fit in a slice of time: (MIXED_STEP_FACTOR
                - 1) decode steps, but at least MIN_PREFILL_SLICE_S; in whole KV blocks, within
                [MIN_BUDGET, MAX_BUDGET]

Measured on a 2-core AMD EPYC (Zen 3, AVX2), SmolLM2-135M Q4_1, 16 streams of 128 in / 128 out
(benchmarks/serve.py): budget 2048 gave 186 output tokens/s, TTFT p50 3.5 s, TPOT p50 59 ms;
512: 170 tokens/s, 1.8 s, 80 ms; 256: 155, 1.4 s, 92 ms; 96: 153, 0.8 s, 98 ms (ITL p90 226 ms).
A measured budget of 288 (a floor of half a second): 164 tokens/s, 1.3 s, 90 ms; 576 (a floor
of one second, the default): 169 tokens/s, 2.0 s, 81 ms. Chunks below ~128 tokens lose the
prefill's matmul efficiency (quant_ops.INT_ACTS_MAX_TOKENS was 128 then) and multiply the
mixed steps; a chunk costs running decodes as much as it costs the prefill, so inter-token
latency does not improve with smaller chunks here, only TTFT does. The one-second floor keeps
most of the throughput and still cuts TTFT p50 to ~0.6x of one-step prefill.

Attention is left out of the measurement: at the short contexts where the budget matters its
cost is a small share of the projections'. A budget the user sets (``max_num_batched_tokens``)
is used as given; CUDA keeps config.DEFAULT_STEP_BUDGET (its kernels are not the ones measured
here), and so does a scheduler without chunked prefill (a prompt must fit one step). Where a
calibration file is given (EngineArgs.calibration; memwall serve finds the default one), the
planner predicts the two speeds instead and nothing is timed here: the policy, ``choose_budget``
and its constants, lives in memwall/planner/serving.py for both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from memwall.planner.serving import (MAX_BUDGET, MAX_DECODE_PROBE, MIN_BUDGET,  # noqa: F401
                                     MIN_PREFILL_SLICE_S, MIXED_STEP_FACTOR, PREFILL_PROBE,
                                     choose_budget)


@dataclass(frozen=True)
class StepShape:
    max_num_batched_tokens: int
    decode_batch: int
    decode_step_s: float
    prefill_tokens_per_s: float

    def describe(self) -> str:
        return (f"step budget {self.max_num_batched_tokens} tokens (measured here: a "
                f"{self.decode_batch}-sequence decode step {self.decode_step_s * 1e3:.1f} ms, "
                f"prefill {self.prefill_tokens_per_s:.0f} tokens/s)")


def _projections(model: nn.Module) -> list[nn.Module]:
    """The modules a token passes through that hold weights (each decoder layer's Linear-like
    children), found by their ``in_features`` attribute: nn.Linear and memwall's QuantLinear."""
    return [m for name, m in model.model.layers.named_modules()
            if hasattr(m, "in_features") and not any(True for _ in m.children())]


WARMUP_TOKENS = 32  # rows of the warm-up pass: the kernels' large-batch path, a quarter of the probe


def _pass_runner(model: nn.Module, projections: list[nn.Module], tokens: int, with_head: bool):
    """rows -> seconds of ``rows`` (<= ``tokens``) rows through every projection (and the LM
    head), on random inputs made once."""
    width = {m.in_features for m in projections}
    with_head = with_head and getattr(model, "lm_head", None) is not None  # a pipeline stage may lack it
    if with_head:
        width.add(model.config.hidden_size)
    inputs = {k: torch.randn(tokens, k) for k in width}

    @torch.inference_mode()
    def run(rows: int) -> float:
        start = time.perf_counter()
        for m in projections:
            m(inputs[m.in_features][:rows])
        if with_head:
            model.compute_logits(inputs[model.config.hidden_size][:rows])
        return time.perf_counter() - start

    return run


def _pass_seconds(model: nn.Module, projections: list[nn.Module], tokens: int,
                  with_head: bool, repeats: int = 1) -> float:
    """Best of ``repeats`` timings of ``tokens`` rows through every projection (and the LM
    head), after one warm-up pass of at most WARMUP_TOKENS rows (threads started, first-call
    allocations made: a full-size warm-up doubled a 1.5B model's start-up measurement)."""
    run = _pass_runner(model, projections, tokens, with_head)
    run(min(tokens, WARMUP_TOKENS))
    return min(run(tokens) for _ in range(repeats))


def measure(model: nn.Module, max_num_seqs: int, block_size: int) -> StepShape:
    """Times a decode step and a prefill chunk on this machine and picks the budget."""
    projections = _projections(model)
    decode_batch = max(1, min(max_num_seqs, MAX_DECODE_PROBE))
    decode_s = _pass_seconds(model, projections, decode_batch, with_head=True)
    prefill_s = _pass_seconds(model, projections, PREFILL_PROBE, with_head=False)
    rate = PREFILL_PROBE / max(prefill_s, 1e-9)
    budget = choose_budget(decode_s, rate, decode_batch, block_size)
    return StepShape(budget, decode_batch, decode_s, rate)


def measure_row_costs(model: nn.Module, sizes: tuple[int, ...], rounds: int = 3) -> dict[int, float]:
    """Seconds of a decode step of n one-token rows (every projection and the LM head) for
    each n in ``sizes``: what speculative decoding weighs its extra rows with
    (memwall/spec_decode/adaptive.py). Best of ``rounds`` rounds, each timing every size in
    turn: a moment the machine is slow then costs one timing of several sizes, not every
    timing of one (timed size by size, one start-up priced 1 row at 7.25 ms and 4 rows at
    6.49 ms; adaptive.StepCost also makes the table monotone)."""
    projections = _projections(model)
    run = _pass_runner(model, projections, max(sizes), with_head=True)
    run(min(max(sizes), WARMUP_TOKENS))
    best = {n: float("inf") for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            best[n] = min(best[n], run(n))
    return best
