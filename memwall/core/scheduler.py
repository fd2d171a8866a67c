"""Scheduler: continuous batching over a per-step token budget, with preemption.

There are no prefill and decode phases. Each request simply has ``num_tokens`` known tokens of
which ``num_computed_tokens`` already have KV in the cache; a step gives every running request
``min(num_tokens - num_computed_tokens, budget left)`` tokens (1 for a decode, a chunk of the
prompt for a prefill) and then admits waiting requests in queue order while budget, sequence
slots and KV blocks last. A newly admitted request starts after its longest cached prefix.

When the pool runs dry a victim is preempted: the most recently admitted running request
(FCFS), or the least important one (priority policy). Recompute frees its blocks and redoes its
prefill later; swap parks its blocks in host memory and brings them back. Either way the oldest
(or most important) request always makes progress, so nothing starves.

n > 1: the extra samples wait as ``fork_children`` of the first; when its prompt is done they
fork its blocks (sharing them, copy on write) and sample their first token from the same logits.

Speculative decoding: a running request whose only token left to compute is its last one may
carry draft tokens the worker proposed (``Request.spec_token_ids``). They join its chunk as far
as the budget, its max_tokens and free blocks allow (drafts never preempt anyone), the worker
verifies them, and ``update`` appends the accepted ones with the token sampled after them;
blocks that only rejected drafts filled go back to the pool.

The scheduler plans with live ``Request`` objects (``ScheduledChunk``) and hands the workers
only plain data (``SchedulerOutput``, memwall/core/step.py): a request's data the first time a
worker sees it, then deltas. ``Request.worker_*`` fields remember what the workers hold.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from memwall.config import SchedulerConfig
from memwall.core.kv.manager import KVCacheManager
from memwall.core.queue import make_queue, priority_key
from memwall.core.step import (CachedRequestData, ForkData, NewRequestData, RunnerOutput,
                               SchedulerOutput)
from memwall.request import Request, RequestStatus

logger = logging.getLogger("memwall")


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of ``request`` get their KV computed this step."""

    request: Request
    start: int
    num_tokens: int
    forks: list[Request] = field(default_factory=list)
    """Pending samples (n > 1) that sample their first token from this chunk's last logits."""
    drafts: list[int] = field(default_factory=list)
    """Draft tokens verified after the request's last known token (counted in num_tokens)."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so the step yields a new token."""
        return self.end - len(self.drafts) == self.request.num_tokens


@dataclass
class _Plan:
    """A step being planned: chunks of live requests, turned into a SchedulerOutput at the end."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_tokens: int = 0
    max_seqs: int | None = None

    @property
    def full(self) -> bool:
        return self.max_seqs is not None and len(self.chunks) >= self.max_seqs

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_tokens += chunk.num_tokens

    def drop(self, request: Request) -> None:
        """A request preempted after it was planned loses its chunk."""
        self.chunks = [c for c in self.chunks if c.request is not request]
        self.num_tokens = sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    spec_num_draft_tokens: int = 0
    """Draft tokens verified (speculative decoding)."""
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    """Sequence-steps that verified drafts: accepted / steps + 1 is the mean tokens per step."""

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_for_worker: list[str] = []
        """Finished requests the workers still hold: told with the next non-empty step."""
        self._in_flight: dict[str, ScheduledChunk] = {}
        """The chunks of the steps being run, by request id (read back by ``update``). With
        pipeline parallel several steps run at once, each of other requests: a request in
        flight is neither scheduled again nor preempted until its step's results are in."""

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    # ---- queue -----------------------------------------------------------------------------
    def add(self, request: Request, fork_children: list[Request] = ()) -> None:
        for r in (request, *fork_children):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for child in fork_children:
            child.status = RequestStatus.FORK_PENDING
            self.requests[child.request_id] = child
        request.fork_children = list(fork_children)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_id: str) -> Request | None:
        """Finishes a request wherever it is; returns it, or None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.FORK_PENDING:
            for parent in self.requests.values():
                if request in parent.fork_children:
                    parent.fork_children.remove(request)
        request.status = status
        if request.worker_num_tokens:
            self._finished_for_worker.append(request.request_id)
            request.worker_num_tokens = 0
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next step: at most ``max_seqs`` sequences when given (pipeline parallel splits
        the runnable requests between the steps in flight), none of those already in flight."""
        plan = _Plan(max_seqs=max_seqs)
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            # Admitting new work in the step that just had to preempt would only thrash.
            self._schedule_waiting(plan, budget)
        return self._to_output(plan)

    @property
    def num_schedulable(self) -> int:
        """Requests a step could take now: running ones not in flight, and the waiting."""
        return sum(r.request_id not in self._in_flight for r in self.running) + len(self.waiting)

    def _schedule_running(self, plan: _Plan, budget: int) -> int:
        for request in list(self.running):
            budget = self.config.max_num_batched_tokens - plan.num_tokens
            if budget <= 0 or plan.full:
                break
            if request not in self.running or request.request_id in self._in_flight:
                continue  # preempted earlier in this loop, or its last step is still running
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            if drafts and not self.kv.allocate_slots(
                    request, request.num_computed_tokens + num_new + len(drafts)):
                drafts = []  # no blocks to spare: verify nothing rather than preempt anyone
            if self._reserve(request, num_new, plan):
                plan.add(self._chunk(request, num_new, drafts))
        return self.config.max_num_batched_tokens - plan.num_tokens

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts that this step can verify (they are used once, or dropped)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        limit = self.config.max_spec_batch
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if limit is not None and len(self.running) > limit:
            return []
        # Every accepted draft is an output token, and one more is sampled after them.
        room = min(budget - num_new, request.max_tokens - request.num_output_tokens - 1)
        drafts = drafts[:max(0, room)]
        if drafts and request.grammar is not None:  # a draft the grammar refuses cannot be accepted
            drafts = drafts[:request.grammar.valid_prefix(drafts)]
        return drafts

    def _reserve(self, request: Request, num_new: int, plan: _Plan) -> bool:
        """Makes room for the request's new tokens, preempting victims; False if it lost."""
        while not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self._pick_victim()
            self._preempt(victim)
            plan.preempted.append(victim)
            # A victim scheduled earlier in this step (priority policy) loses its chunk too.
            plan.drop(victim)
            if victim is request:
                return False
        return True

    def _pick_victim(self) -> Request:
        """The request that gives up its blocks (never one whose step is still running: its
        blocks are being written; the request asking is never in flight, so one exists)."""
        candidates = [r for r in self.running if r.request_id not in self._in_flight]
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=priority_key)
        return candidates[-1]

    def _schedule_waiting(self, plan: _Plan, budget: int) -> None:
        while self.waiting and budget > 0 and not plan.full:
            request = self._next_admissible()
            if request is None or not self._has_seq_slots(request):
                break
            swapped = request.status is RequestStatus.SWAPPED
            cached = [] if swapped else self.kv.find_cached_prefix(request)
            if not swapped:
                request.num_computed_tokens = len(cached) * self.kv.block_size
                request.num_cached_tokens = request.num_computed_tokens
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            total = request.num_computed_tokens + num_new
            if swapped and not self.kv.can_swap_in(request.request_id, total):
                break
            if swapped:
                self.kv.swap_in(request.request_id)
            if not self.kv.allocate_slots(request, total, cached):
                break  # queue order: a later request must not overtake the head
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(self._chunk(request, num_new))
            budget -= num_new

    def _next_admissible(self) -> Request | None:
        """The first waiting request in queue order whose adapter can join the running ones:
        at most ``max_loras`` adapters run at once (the workers' slots). A request of another
        adapter waits, and the requests behind it may go first (vLLM does the same)."""
        limit = self.config.max_loras
        if limit is None:
            return self.waiting.peek()
        running = {r.lora_id for r in self.running if r.lora_id}
        for request in self.waiting:
            if not request.lora_id or request.lora_id in running or len(running) < limit:
                return request
        return None

    def _has_seq_slots(self, request: Request) -> bool:
        reserved = sum(1 + len(r.fork_children) for r in self.running)
        return reserved + 1 + len(request.fork_children) <= self.config.max_num_seqs

    def _chunk(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledChunk:
        chunk = ScheduledChunk(request, request.num_computed_tokens, num_new + len(drafts),
                               drafts=list(drafts))
        if chunk.samples and request.fork_children:
            chunk.forks = list(request.fork_children)
        return chunk

    # ---- the plan as plain data ------------------------------------------------------------
    def _to_output(self, plan: _Plan) -> SchedulerOutput:
        rewritten = self.kv.take_rewritten()
        out = SchedulerOutput(
            preempted_ids=[r.request_id for r in plan.preempted if r.worker_num_tokens],
            transfers=self.kv.take_transfers())
        for victim in plan.preempted:
            victim.worker_num_tokens = victim.worker_num_blocks = 0
        self._in_flight.update((c.request.request_id, c) for c in plan.chunks)
        for chunk in plan.chunks:
            request = chunk.request
            out.num_scheduled_tokens[request.request_id] = chunk.num_tokens
            if chunk.drafts:
                out.spec_token_ids[request.request_id] = chunk.drafts
            if request.worker_num_tokens == 0 or request.request_id in rewritten:
                out.new_requests.append(self._new_data(request))
            else:
                out.cached_requests.append(self._cached_data(request))
            out.forks.extend(ForkData(f.request_id, request.request_id, f.sampling_params,
                                      f.eos_token_ids) for f in chunk.forks)
            if chunk.samples:
                for sampler in (request, *chunk.forks):
                    if sampler.grammar is not None:
                        drafts = chunk.drafts if sampler is request else []
                        out.grammar_bitmask[sampler.request_id] = sampler.grammar.bitmask(drafts)
        if out.num_scheduled_tokens:  # an empty step does not reach the workers: keep them
            out.finished_ids.extend(self._finished_for_worker)
            self._finished_for_worker.clear()
        return out

    def _new_data(self, request: Request) -> NewRequestData:
        table = self.kv.block_table(request.request_id)
        request.worker_num_tokens, request.worker_num_blocks = request.num_tokens, len(table)
        return NewRequestData(request.request_id, request.prompt_token_ids,
                              list(request.output_token_ids), request.sampling_params,
                              request.eos_token_ids, list(table), request.num_computed_tokens,
                              len(request.prompt_logprobs), request.lora_id)

    def _cached_data(self, request: Request) -> CachedRequestData:
        table = self.kv.block_table(request.request_id)
        # Only output tokens are ever appended: the worker already holds the whole prompt.
        new_tokens = request.output_token_ids[request.worker_num_tokens - request.num_prompt_tokens:]
        new_blocks = table[request.worker_num_blocks:]
        request.worker_num_tokens, request.worker_num_blocks = request.num_tokens, len(table)
        return CachedRequestData(request.request_id, new_tokens, new_blocks,
                                 request.num_computed_tokens, len(table))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(request.request_id):
            self.kv.swap_out(request.request_id)
            request.status = RequestStatus.SWAPPED
            self.stats.num_preemptions_swap += 1
        else:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.stats.num_preemptions_recompute += 1
        request.num_preemptions += 1
        self.waiting.add_front(request)

    # ---- results ---------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Applies a step's results; returns the requests that got a new token (finished or not)."""
        touched = []
        for request_id in sched.num_scheduled_tokens:
            chunk = self._in_flight.pop(request_id)
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.end - len(chunk.drafts)
            self.kv.cache_full_blocks(request)
            if request.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])
            touched.extend(self._start_forks(chunk, result))
            sampled = result.sampled.get(request.request_id)
            if sampled is not None:
                accepted = self._count_verified(chunk, result)
                for token in (*accepted, sampled):
                    self._append_token(request, token.token_id, token.logprobs)
                    if request.is_finished:
                        break
                touched.append(request)
                if not request.is_finished:
                    self._after_verify(request, chunk, len(accepted))
                    request.spec_token_ids = result.draft_token_ids.get(request.request_id, [])
        return touched

    def _count_verified(self, chunk: ScheduledChunk, result: RunnerOutput) -> list:
        """The drafts the worker accepted (none when the chunk verified none), counted."""
        if not chunk.drafts:
            return []
        accepted = result.accepted_drafts.get(chunk.request.request_id, [])
        request, stats = chunk.request, self.stats
        request.num_draft_tokens += len(chunk.drafts)
        request.num_accepted_tokens += len(accepted)
        request.num_verify_steps += 1
        stats.spec_num_draft_tokens += len(chunk.drafts)
        stats.spec_num_accepted_tokens += len(accepted)
        stats.spec_num_verify_steps += 1
        return accepted

    def _after_verify(self, request: Request, chunk: ScheduledChunk, num_accepted: int) -> None:
        """Accepted drafts' KV is valid (they were computed from the right tokens); the blocks
        past the request's tokens held only rejected drafts and go back to the pool."""
        if not chunk.drafts:
            return
        request.num_computed_tokens += num_accepted
        self.kv.cache_full_blocks(request)
        self.kv.trim(request.request_id, request.num_tokens)
        # Blocks the workers hold past the trimmed table are stale: resend from there on.
        request.worker_num_blocks = min(request.worker_num_blocks,
                                        len(self.kv.block_table(request.request_id)))

    def _start_forks(self, chunk: ScheduledChunk, result: RunnerOutput) -> list[Request]:
        """The parent's prompt is done: each pending sample forks its blocks and takes its token."""
        started = []
        for child in chunk.forks:
            if child.status is not RequestStatus.FORK_PENDING or child.request_id not in result.sampled:
                continue  # aborted meanwhile
            chunk.request.fork_children.remove(child)
            self.kv.fork(chunk.request, child)
            child.num_computed_tokens = chunk.end
            child.first_scheduled_time = chunk.request.first_scheduled_time
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            sampled = result.sampled[child.request_id]
            self._append_token(child, sampled.token_id, sampled.logprobs)
            started.append(child)
        return started

    def _append_token(self, request: Request, token_id: int, logprobs: dict | None) -> None:
        request.output_token_ids.append(token_id)
        if request.sampling_params.logprobs is not None:
            request.output_logprobs.append(logprobs)
        status = self._grammar_status(request, token_id) or self._stop_status(request, token_id)
        if status is not None:
            self.finish(request, status)

    @staticmethod
    def _grammar_status(request: Request, token_id: int) -> RequestStatus | None:
        """A structured-output request stops once its grammar is complete (its EOS, or nothing
        more allowed). A token the grammar refuses means the mask was not applied: stop there
        rather than return output that breaks the promised format."""
        grammar = request.grammar
        if grammar is None:
            return None
        if not grammar.accept([token_id]):
            logger.error("request %s: token %d breaks its grammar; stopping it", request.request_id,
                         token_id)
            request.stop_reason = "grammar"
            return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
