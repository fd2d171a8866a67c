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
"""

from __future__ import annotations

from dataclasses import dataclass

from memwall.config import SchedulerConfig
from memwall.core.kv.manager import KVCacheManager
from memwall.core.queue import make_queue, priority_key
from memwall.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput
from memwall.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0

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
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_ids:
            # Admitting new work in the step that just had to preempt would only thrash.
            self._schedule_waiting(out, budget)
        out.transfers = self.kv.take_transfers()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            budget = self.config.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._reserve(request, num_new, out):
                out.chunks.append(self._chunk(request, num_new))
        return self.config.max_num_batched_tokens - out.num_tokens

    def _reserve(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Makes room for the request's new tokens, preempting victims; False if it lost."""
        while not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self._pick_victim(out)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            # A victim scheduled earlier in this step (priority policy) loses its chunk too.
            out.chunks = [c for c in out.chunks if c.request is not victim]
            if victim is request:
                return False
        return True

    def _pick_victim(self, out: SchedulerOutput) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self._has_seq_slots(self.waiting.peek()):
            request = self.waiting.peek()
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
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _has_seq_slots(self, request: Request) -> bool:
        reserved = sum(1 + len(r.fork_children) for r in self.running)
        return reserved + 1 + len(request.fork_children) <= self.config.max_num_seqs

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        chunk = ScheduledChunk(request, request.num_computed_tokens, num_new,
                               self.kv.block_table(request.request_id))
        if chunk.samples and request.fork_children:
            chunk.forks = list(request.fork_children)
        return chunk

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
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
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.end
            self.kv.cache_full_blocks(request)
            if request.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])
            touched.extend(self._start_forks(chunk, result))
            sampled = result.sampled.get(request.request_id)
            if sampled is not None:
                self._append_token(request, sampled.token_id, sampled.logprobs)
                touched.append(request)
        return touched

    def _start_forks(self, chunk: ScheduledChunk, result: RunnerOutput) -> list[Request]:
        """The parent's prompt is done: each pending sample forks its blocks and takes its token."""
        started = []
        for child in chunk.forks:
            if child.status is not RequestStatus.FORK_PENDING or child.request_id not in result.sampled:
                continue  # aborted meanwhile
            chunk.request.fork_children.remove(child)
            self.kv.fork(chunk.request, child)
            child.num_computed_tokens = chunk.end
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
        status = self._stop_status(request, token_id)
        if status is not None:
            self.finish(request, status)

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
