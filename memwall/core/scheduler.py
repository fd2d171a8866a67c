"""Scheduler: continuous batching over a per-step token budget, with preemption by recompute.

There are no prefill and decode phases. Each request simply has ``num_tokens`` known tokens of
which ``num_computed_tokens`` already have KV in the cache; a step gives every running request
``min(num_tokens - num_computed_tokens, budget left)`` tokens (1 for a decode, a chunk of the
prompt for a prefill) and then admits waiting requests FCFS while budget, sequence slots and KV
blocks last. When the pool runs dry the most recently admitted running request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later, so the
oldest request always makes progress and nothing starves.
"""

from __future__ import annotations

from collections import deque

from memwall.config import SchedulerConfig
from memwall.core.kv.manager import KVCacheManager
from memwall.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput
from memwall.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finishes a request wherever it is; returns it, or None if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
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
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            # Admitting new work in the step that just had to preempt would only thrash.
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new, out):
                break  # the request itself was preempted: everything after it is gone too
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _reserve(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Makes room for the request's new tokens, preempting from the back; False if it lost."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break  # FCFS: a later request must not overtake the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        return ScheduledChunk(request, request.num_computed_tokens, num_new,
                              self.kv.block_table(request.request_id))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results ---------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Applies a step's results; returns the requests that got a new token (finished or not)."""
        touched = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens = chunk.end
            if chunk.request.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])
            sampled = result.sampled.get(request.request_id)
            if sampled is None:
                continue
            self._append_token(request, sampled.token_id, sampled.logprobs)
            touched.append(request)
        return touched

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
