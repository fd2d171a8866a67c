"""EngineCore: the scheduler and the executor, nothing else. It takes plain requests in and
gives plain outputs back (memwall/engine/protocol.py), so it runs the same in-process (offline
``LLM``) and in a process of its own (``memwall serve``, memwall/engine/core_client.py).

    step():  scheduler.schedule()  -> SchedulerOutput   (plain data: new requests, then deltas)
             executor.submit()                          (pipeline parallel: one step a stage
             executor.collect()    -> RunnerOutput       in flight, each of other requests)
             scheduler.update()    -> requests that got a token (stop checks, cache, free)
             -> EngineCoreOutputs  (new tokens per sample, finish reasons, stats, and for the
                                    live dashboard the step's record: memwall/core/live_trace.py)

It holds no tokenizer and touches no device: text lives on the API side, tensors in the worker.
Requests that need something first wait in ``_preparing``: a structured-output request for its
grammar (compiled on the StructuredOutputManager's thread), a LoRA request for its adapter
(loaded on the workers by the LoRARegistry's thread); then they join the scheduler, and nobody
else waits for them.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from memwall.config import EngineArgs
from memwall.core.kv.manager import KVCacheManager
from memwall.core.live_trace import LiveTrace, TraceRecorder
from memwall.core.scheduler import Scheduler
from memwall.core.step import SchedulerOutput
from memwall.core.step_record import record_step
from memwall.engine import sizing
from memwall.engine.protocol import (EngineCoreInfo, EngineCoreOutput, EngineCoreOutputs,
                                     EngineCoreRequest, EngineStats)
from memwall.executor import Executor, make_executor
from memwall.lora.registry import LoRARegistry, PendingAdapter
from memwall.request import Request, RequestStatus
from memwall.structured.backend import GrammarError
from memwall.structured.manager import PendingGrammar, StructuredOutputManager

# With nothing to run but grammars compiling, a step waits this long for one to finish
# (instead of returning at once and being called again in a busy loop).
COMPILE_WAIT_S = 0.05


@dataclass
class _Preparing:
    """A request and its n > 1 forks, waiting for what they need before they can be scheduled:
    their adapter loaded on the workers, each sample's grammar compiled."""

    samples: list[tuple[Request, PendingGrammar | None]]
    """The first sample, then the forks."""
    adapter: PendingAdapter | None = None

    @property
    def requests(self) -> list[Request]:
        return [request for request, _ in self.samples]

    @property
    def ready(self) -> bool:
        return ((self.adapter is None or self.adapter.ready)
                and all(p is None or p.ready for _, p in self.samples))

    def wait(self, timeout: float) -> None:
        waiting = [p for _, p in self.samples if p is not None and not p.ready]
        if self.adapter is not None and not self.adapter.ready:
            waiting.insert(0, self.adapter)
        if waiting:
            waiting[0].wait(timeout)

logger = logging.getLogger("memwall")


class EngineCore:
    def __init__(self, args: EngineArgs, executor: Executor | None = None) -> None:
        """``executor``: a prepared one (tests and benchmarks hand in a model built in memory);
        by default one is made from ``args`` and loads ``args.model``."""
        self.executor = executor or make_executor(args)
        model = self.executor.load_model()
        sched_cfg = args.scheduler_config(model.max_len)
        plan = self.executor.determine_num_blocks(args.cache_config(), sched_cfg)
        self.max_model_len = min(sched_cfg.max_model_len, plan.max_tokens)
        sizes = sizing.choose(args, model, plan, self.max_model_len, sched_cfg)
        self.executor.init_cache(plan, sizes.sched.max_num_seqs, self.max_model_len)
        sizes = sizing.measure(args, sizes, plan.block_size, self.executor)
        sched_cfg = sizes.sched
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size,
                                 args.cache_config().enable_prefix_caching, plan.num_swap_blocks)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        description = f"{plan.describe()}; context window {self.max_model_len} tokens; {sizes.text}"
        device_text = self.executor.describe()
        self.info = EngineCoreInfo(model.name, self.max_model_len, model.vocab_size,
                                   sched_cfg.max_num_seqs,
                                   description + (f"; {device_text}" if device_text else ""),
                                   args.structured_outputs_backend, model.arch,
                                   args.max_lora_rank if args.enable_lora else None)
        self.structured = (StructuredOutputManager(model.vocab, args.structured_outputs_backend,
                                                   warmup=args.structured_outputs_warmup)
                           if model.vocab is not None else None)
        self.lora = (LoRARegistry(self.executor.add_lora, self.executor.remove_lora,
                                  args.host_loras, args.lora_cache_policy)
                     if args.enable_lora else None)
        if self.lora is not None and self.lora.cache_policy == "adapter-aware":
            self.kv.pool.evict_value = self.lora.kv_value
            self.kv.pool.block_cost_s = plan.block_size / sizes.prefill_tokens_per_s
            self.lora.attach_pool(self.kv.pool, self.executor.park_lora, self._adapters_in_use)
        self._steps: collections.deque[SchedulerOutput] = collections.deque()
        """Steps submitted to the executor and not yet collected, oldest first."""
        self._preparing: list[_Preparing] = []
        self._unloading: set[int] = set()
        """Adapters unloaded by the API while requests still use them: dropped when they end."""
        self.trace = TraceRecorder()
        """Each step's record and, while a page watches, the block map (the live dashboard)."""

    @property
    def live(self) -> LiveTrace:
        """Recent steps and the latest block map, as an in-process dashboard reads them."""
        return self.trace.live

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None:
        """Queues one sample; ``forks`` (n > 1) share its prefill and fork its KV blocks.
        A structured-output request first waits for its grammar (compiled off the step loop),
        a LoRA request for its adapter (loaded off the step loop)."""
        request, children = _to_request(first), [_to_request(f) for f in forks]
        constraint, lora = first.sampling_params.structured_outputs, first.lora_request
        if lora is None and self.lora is not None:
            self.lora.observe(0)  # the base model's KV competes with the adapters' for the pool
        if constraint is None and lora is None:
            self.scheduler.add(request, fork_children=children)
            return
        if constraint is not None and self.structured is None:
            raise ValueError("this engine's model has no tokenizer vocabulary for structured outputs")
        if lora is not None and self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (--enable-lora)")
        ids = {r.request_id for r in self.scheduler.requests.values()}
        ids.update(r.request_id for c in self._preparing for r in c.requests)
        taken = next((r.request_id for r in (request, *children) if r.request_id in ids), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} is already in use")
        grammar = (lambda r: self.structured.submit(r.sampling_params.structured_outputs)) \
            if constraint is not None else (lambda r: None)
        adapter = self.lora.submit(lora, self._adapters_in_use()) if lora is not None else None
        self._preparing.append(_Preparing([(r, grammar(r)) for r in (request, *children)], adapter))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finishes these samples wherever they are; their blocks are free before the next step."""
        gone = set(request_ids)
        for entry in self._preparing:  # a request whose first sample is aborted goes whole
            first = entry.samples[0][0]
            entry.samples = [s for s in entry.samples if s[0] is first or s[0].request_id not in gone]
        self._preparing = [c for c in self._preparing if c.samples[0][0].request_id not in gone]
        for request_id in request_ids:
            self.scheduler.abort(request_id)
        if not self.has_unfinished_requests():  # an in-process dashboard sees the blocks freed
            self.trace.maybe_view(self.scheduler, force=True)

    def set_watched(self, watched: bool) -> None:
        """A dashboard page opened (or the last one closed): build the block map while one
        is open, the first one at once."""
        self.trace.watched = watched
        self.trace.maybe_view(self.scheduler, force=True)

    def remove_lora(self, lora_int_id: int) -> None:
        """The API side unloaded this adapter: it leaves the workers once no request uses it."""
        if self.lora is not None:
            self._unloading.add(lora_int_id)
            self._drop_unloaded()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._preparing)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        started, clock = time.time(), time.perf_counter()
        failed = self._admit_prepared()
        self._fill_pipeline()
        if not self._steps:
            return self._outputs(failed)
        sched = self._steps.popleft()
        result = self.executor.collect()
        # before update(): each request's num_computed_tokens is still where its chunk began
        record = record_step(self.trace.num_steps, started, sched, result, self.scheduler.requests)
        touched = self.scheduler.update(sched, result)
        if self._unloading:
            self._drop_unloaded()
        record.duration_s = time.perf_counter() - clock
        self.trace.record(record)
        return self._outputs(failed + [_output(r) for r in touched])

    def idle(self) -> EngineCoreOutputs:
        """The answer to a round with nothing to step (an abort freed blocks): stats, and a
        fresh block map."""
        return self._outputs([])

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        # An engine going idle gets a fresh map at once: the page must not keep showing blocks
        # the last step freed until the next request comes.
        self.trace.maybe_view(self.scheduler, force=not self.has_unfinished_requests())
        return EngineCoreOutputs(outputs, self.stats(), self.trace.take())

    def _fill_pipeline(self) -> None:
        """Submits steps until the executor holds ``pipeline_depth`` of them (one without
        pipeline parallel). With several stages the runnable requests are split evenly
        between the steps in flight, so each stage always has a batch to run."""
        depth = self.executor.pipeline_depth
        while len(self._steps) < depth:
            free = depth - len(self._steps)
            share = None if depth == 1 else max(1, -(-self.scheduler.num_schedulable // free))
            sched = self.scheduler.schedule(share)
            if sched.is_empty:
                return
            self.executor.submit(sched)
            self._steps.append(sched)

    def _admit_prepared(self) -> list[EngineCoreOutput]:
        """Requests whose adapter and grammars are ready join the scheduler; one whose adapter
        failed to load or grammar failed to compile finishes ("abort", the error as
        stop_reason). With nothing else to run, waits a little rather than spin."""
        if not self._preparing:
            return []
        if self.lora is not None:
            self.lora.pump(self._adapters_in_use())  # queued loads, as requests end
        if not self.scheduler.has_unfinished:
            self._preparing[0].wait(COMPILE_WAIT_S)
        failed = []
        for entry in [c for c in self._preparing if c.ready]:
            self._preparing.remove(entry)
            first, *forks = entry.requests
            try:
                self._attach_adapter(entry)
                for request, pending in entry.samples:
                    if pending is not None:
                        request.grammar = self.structured.take(pending)
            except (GrammarError, ValueError) as e:
                logger.warning("request %s cannot run: %s", first.request_id, e)
                for request in entry.requests:
                    request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, str(e)
                    failed.append(_output(request))
                continue
            self.scheduler.add(first, fork_children=forks)
        return failed

    def _attach_adapter(self, entry: _Preparing) -> None:
        """Each sample runs with the loaded adapter, its KV in the adapter's cache namespace.
        Raises the load's error (LoRAError is a ValueError)."""
        if entry.adapter is None:
            return
        info = self.lora.take(entry.adapter)
        lora = entry.adapter.lora
        for request in entry.requests:
            request.lora_id = lora.lora_int_id
            request.cache_extra_keys = request.cache_extra_keys + self.lora.cache_key(lora, info)

    def _adapters_in_use(self) -> set[int]:
        """Adapters of live requests, and of requests about to join (loaded, not yet admitted)."""
        live = {r.lora_id for r in self.scheduler.requests.values() if r.lora_id}
        live.update(c.adapter.lora.lora_int_id for c in self._preparing if c.adapter is not None)
        return live

    def _drop_unloaded(self) -> None:
        idle = self._unloading - self._adapters_in_use()
        for lora_int_id in idle:
            self.lora.unload(lora_int_id, forever=True)
        self._unloading -= idle

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv
        return EngineStats(len(scheduler.running), len(scheduler.waiting), kv.num_free_blocks,
                           kv.num_total_blocks, scheduler.num_preemptions,
                           scheduler.stats.num_preemptions_recompute,
                           scheduler.stats.num_preemptions_swap, kv.stats.queries, kv.stats.hits,
                           kv.pool.num_evictions, scheduler.stats.spec_num_draft_tokens,
                           scheduler.stats.spec_num_accepted_tokens,
                           scheduler.stats.spec_num_verify_steps,
                           self.lora.snapshot(kv.stats.per_namespace, kv.pool.cached_per_owner)
                           if self.lora is not None else None)

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        if self.lora is not None:
            self.lora.shutdown()
        self.executor.shutdown()


def _to_request(req: EngineCoreRequest) -> Request:
    request = Request(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                      req.max_tokens, req.eos_token_ids, req.arrival_time,
                      cache_extra_keys=req.cache_extra_keys)
    if req.sampling_params.prompt_logprobs is not None:
        request.prompt_logprobs.append(None)  # position 0 is not predicted by anything
    return request


def _output(request: Request) -> EngineCoreOutput:
    """The sample's news since its last output: new tokens (and logprobs), new prompt logprobs,
    and how it finished."""
    sent, prompt_sent = request.num_output_tokens_sent, request.num_prompt_logprobs_sent
    out = EngineCoreOutput(request.request_id, request.output_token_ids[sent:],
                           num_cached_tokens=request.num_cached_tokens,
                           spec_counts=(request.num_draft_tokens, request.num_accepted_tokens,
                                        request.num_verify_steps))
    if request.sampling_params.logprobs is not None:
        out.new_logprobs = request.output_logprobs[sent:]
    if request.sampling_params.prompt_logprobs is not None:
        out.new_prompt_logprobs = request.prompt_logprobs[prompt_sent:]
        request.num_prompt_logprobs_sent = len(request.prompt_logprobs)
    if sent == 0:
        out.first_scheduled_time = request.first_scheduled_time
    request.num_output_tokens_sent = request.num_output_tokens
    if request.is_finished:
        out.finish_reason, out.stop_reason = request.status.value, request.stop_reason
    return out

