"""StepRecord: what one engine step ran, for the live dashboard's timeline (continuous batching
as it happens). Recorded by the engine core once a step, from the step's SchedulerOutput and
RunnerOutput; it crosses to the API process with the step's outputs (memwall/engine/protocol.py).

A record is columnar, one tuple per field with one entry per request that ran:

    index 41  started 1717.2  duration 0.012 s
    request_ids     ("a",  "b", "c")
    prefill_tokens  (  0,  96,   0)     b: a 96-token chunk of its prompt
    decode_tokens   (  1,   0,   4)     c: its last token + 3 drafts to verify
    new_tokens      (  1,   0,   3)     c: 2 drafts accepted + the token sampled after them
    spec_proposed   (  0,   0,   3)
    spec_accepted   (  0,   0,   2)

Columns rather than an object per request: a step is pickled every step, and tuples of ints
pickle several times faster than small objects (memwall's step is a few ms on a tiny model).

"Prefill" is every token a request catches up on (its prompt, in chunks; a preempted request's
recompute); "decode" is a step that runs only its last known token (plus any drafts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memwall.core.step import RunnerOutput, SchedulerOutput
from memwall.request import Request


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a step (a row view of a StepRecord's columns)."""

    request_id: str
    prefill_tokens: int
    decode_tokens: int
    new_tokens: int
    """Tokens appended to its output this step (0 for a prompt chunk that is not the last)."""
    spec_proposed: int = 0
    spec_accepted: int = 0


@dataclass
class StepRecord:
    """One step. Filled once by the engine core (``duration_s`` right after the step's results
    are applied) and never changed after it is published."""

    index: int
    """Steps since the engine core started, from 0."""
    started: float
    """time.time() when the step began (wall clock: the page shows it)."""
    duration_s: float
    request_ids: tuple[str, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    decode_tokens: tuple[int, ...] = ()
    new_tokens: tuple[int, ...] = ()
    spec_proposed: tuple[int, ...] = ()
    spec_accepted: tuple[int, ...] = ()

    def entries(self) -> list[RequestStep]:
        return [RequestStep(*row) for row in zip(self.request_ids, self.prefill_tokens,
                                                 self.decode_tokens, self.new_tokens,
                                                 self.spec_proposed, self.spec_accepted)]

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_tokens) + sum(self.decode_tokens)


def record_step(index: int, started: float, sched: SchedulerOutput, result: RunnerOutput,
                requests: Mapping[str, Request]) -> StepRecord:
    """The record of a step whose results are in but not yet applied: each request's
    ``num_computed_tokens`` is still where its chunk started. ``duration_s`` is left 0 for the
    caller to fill once the step is over. A request aborted while its step ran counts as prefill
    (its state is gone; nothing it computed is kept)."""
    spec, accepted_drafts, sampled = sched.spec_token_ids, result.accepted_drafts, result.sampled
    rows = []
    for request_id, num_tokens in sched.num_scheduled_tokens.items():
        drafts = len(spec[request_id]) if request_id in spec else 0
        accepted = len(accepted_drafts.get(request_id, ())) if drafts else 0
        new = 1 + accepted if request_id in sampled else 0
        request = requests.get(request_id)
        decode = request is not None and _is_decode(request, num_tokens - drafts)
        rows.append((request_id, 0 if decode else num_tokens, num_tokens if decode else 0, new,
                     drafts, accepted))
    columns = tuple(zip(*rows)) if rows else ((),) * 6
    return StepRecord(index, started, 0.0, *columns)


def _is_decode(request: Request, num_known_tokens: int) -> bool:
    """One token past the prompt, and it is the request's last known one."""
    if num_known_tokens != 1:
        return False
    start, outputs = request.num_computed_tokens, len(request.output_token_ids)
    prompt = len(request.prompt_token_ids)
    return start >= prompt and start + 1 == prompt + outputs
