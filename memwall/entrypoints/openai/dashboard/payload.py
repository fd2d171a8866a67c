"""What the dashboard page receives, as JSON-ready dicts built from what the engine thread last
published (``AsyncLLMEngine.stats`` and ``.live``). Nothing here calls into the engine core.

One event of the stream:

    {"trace_id": ..,          a new id after an engine restart (the page clears its timeline)
     "now": time.time(),
     "stats": {..},           counters and gauges (all data-parallel replicas summed)
     "view": {..} | null,     block map and queues (replica 0 under data parallel)
     "throughput": {..},      tokens/s over the last few seconds of steps
     "batching": {..},        continuous vs static batching for the steps kept
     "steps": [..]}           the steps this client has not seen yet, oldest first
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from memwall.core.batching_efficiency import compare
from memwall.core.live_view import CoreView, QueuedRequest
from memwall.core.step_record import StepRecord
from memwall.engine.protocol import EngineStats

THROUGHPUT_WINDOW_S = 5.0
STATIC_BATCHES_SHOWN = 64
"""The static-batching picture draws the most recent batches only."""


def stats_dict(stats: EngineStats) -> dict:
    return {
        "running": stats.num_running, "waiting": stats.num_waiting,
        "free_blocks": stats.num_free_blocks, "total_blocks": stats.num_total_blocks,
        "kv_usage": stats.kv_cache_usage,
        "prefix_queries": stats.prefix_cache_queries, "prefix_hits": stats.prefix_cache_hits,
        "prefix_hit_rate": stats.prefix_cache_hit_rate,
        "evictions": stats.prefix_cache_evictions, "preemptions": stats.num_preemptions,
        "spec_draft_tokens": stats.spec_num_draft_tokens,
        "spec_accepted_tokens": stats.spec_num_accepted_tokens,
        "spec_acceptance": stats.spec_acceptance_rate,
        "spec_mean_accepted_length": stats.spec_mean_accepted_length,
    }


def view_dict(view: CoreView | None) -> dict | None:
    if view is None:
        return None
    return {"built": view.built, "states": view.states,
            "tables": {rid: list(blocks) for rid, blocks in view.tables.items()},
            "running": [_queued(q) for q in view.running],
            "waiting": [_queued(q) for q in view.waiting]}


def _queued(q: QueuedRequest) -> list:
    return [q.request_id, q.num_computed_tokens, q.num_prompt_tokens, q.num_output_tokens,
            q.status]


def step_dict(step: StepRecord) -> dict:
    """A step as the page draws it: ``r`` rows of [id, prefill, decode, new, proposed, accepted]."""
    return {"i": step.index, "t": step.started, "ms": round(step.duration_s * 1000, 3),
            "r": [list(row) for row in zip(step.request_ids, step.prefill_tokens,
                                           step.decode_tokens, step.new_tokens,
                                           step.spec_proposed, step.spec_accepted)]}


def throughput(steps: Sequence[StepRecord], now: float | None = None,
               window_s: float = THROUGHPUT_WINDOW_S) -> dict:
    """Tokens per second over the steps that ended in the last ``window_s`` seconds. When the
    oldest step kept is inside the window (the engine just started, or the ring dropped older
    ones), the window starts with it instead: what came before it is not known."""
    now = time.time() if now is None else now
    start = now - window_s
    recent = [s for s in steps if s.started + s.duration_s >= start]
    if recent and recent[0] is steps[0] and recent[0].started > start:
        start = recent[0].started
    span = max(now - start, 1e-9)
    generated = sum(sum(s.new_tokens) for s in recent)
    prefill = sum(sum(s.prefill_tokens) for s in recent)
    busy = sum(s.duration_s for s in recent)
    return {"window_s": round(span, 3), "generated_tok_s": generated / span,
            "prefill_tok_s": prefill / span, "steps": len(recent),
            "step_ms_mean": busy / len(recent) * 1000 if recent else 0.0,
            "busy_share": min(1.0, busy / span)}


def batching_dict(steps: list[StepRecord]) -> dict:
    result = compare(steps)
    return {"batch_size": result.batch_size, "continuous": result.continuous,
            "static": result.static, "static_idle": result.static_idle,
            "continuous_busy": result.continuous_busy,
            "continuous_slots": result.continuous_slots,
            "static_busy": result.static_busy, "static_slots": result.static_slots,
            "num_batches": len(result.static_batches),
            "batches": [[[r.request_id, r.output_tokens] for r in batch]
                        for batch in result.static_batches[-STATIC_BATCHES_SHOWN:]],
            "num_steps": len(steps)}
