"""Continuous batching against static batching, for the same requests (the dashboard's
"bubbles" panel).

The unit is the slot-step: a batch of ``B`` sequence slots run for one step. A slot-step is
busy when a request runs in it, idle (a bubble) otherwise.

Continuous (measured, from the engine's step records): every step runs whichever requests are
in flight; B is the most requests any one step of the trace ran, so

    continuous efficiency = sum over steps of requests run / (B * steps)

Static (computed): the same requests, in order of their first step, cut into batches of B. A
static batch prefills together and then decodes until its longest request is done, one token
per slot per step; a request that finished early leaves its slot idle:

    batch of B = 3, outputs 2, 8, 4 tokens:     a ██······      busy 2 + 8 + 4 = 14
                                                b ████████      slots 3 * 8 = 24
                                                c ████····      efficiency 14 / 24

    static efficiency = sum of output tokens / sum over batches of (B * longest output)

The static batcher is given every request at once (no arrival gaps), which flatters it: the
measured continuous figure includes the engine's own idle slots while requests trickled in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memwall.core.step_record import StepRecord


@dataclass(frozen=True)
class RequestLengths:
    """One request as the trace saw it."""

    request_id: str
    first_step: int
    prompt_tokens: int
    """Prefill tokens the trace saw it run (prefix-cache hits are not run, so not counted)."""
    output_tokens: int


@dataclass(frozen=True)
class BatchingEfficiency:
    batch_size: int
    continuous_busy: int
    """Slot-steps in which a request ran (continuous batching, measured)."""
    continuous_slots: int
    static_busy: int
    """Output tokens: a static slot is busy once per token of its request."""
    static_slots: int
    static_batches: tuple[tuple[RequestLengths, ...], ...] = ()
    """The static batches, in order (for the picture)."""

    @property
    def continuous(self) -> float:
        return self.continuous_busy / self.continuous_slots if self.continuous_slots else 0.0

    @property
    def static(self) -> float:
        return self.static_busy / self.static_slots if self.static_slots else 0.0

    @property
    def batch_lengths(self) -> tuple[tuple[int, ...], ...]:
        """Each static batch's output lengths."""
        return tuple(tuple(r.output_tokens for r in batch) for batch in self.static_batches)

    @property
    def static_idle(self) -> int:
        """Bubbles: slot-steps a static batcher would have left idle."""
        return self.static_slots - self.static_busy


def request_lengths(steps: Iterable[StepRecord]) -> list[RequestLengths]:
    """Each request of the trace, in order of its first step (ties in batch order)."""
    seen: dict[str, list[int]] = {}
    for step in steps:
        for rid, prefill, new in zip(step.request_ids, step.prefill_tokens, step.new_tokens):
            entry = seen.setdefault(rid, [step.index, 0, 0])
            entry[1] += prefill
            entry[2] += new
    return [RequestLengths(rid, first, prompt, out) for rid, (first, prompt, out) in seen.items()]


def static_batches(requests: list, batch_size: int) -> list[tuple]:
    """Requests cut into consecutive batches of ``batch_size`` (the last may be short)."""
    return [tuple(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size)]


def compare(steps: list[StepRecord]) -> BatchingEfficiency:
    """Continuous (as measured by ``steps``) against static batching for the same requests."""
    ran = [len(step.request_ids) for step in steps if step.request_ids]
    if not ran:
        return BatchingEfficiency(0, 0, 0, 0, 0)
    size = max(ran)
    # A request with no output in the window yet (its prompt still being prefilled) has no
    # length a static batch could wait for: it is left out of the static side.
    requests = [r for r in request_lengths(steps) if r.output_tokens]
    batches = static_batches(requests, size)
    static_slots = sum(size * max(r.output_tokens for r in batch) for batch in batches)
    return BatchingEfficiency(size, sum(ran), size * len(ran),
                              sum(r.output_tokens for r in requests), static_slots, tuple(batches))
