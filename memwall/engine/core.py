"""EngineCore: the scheduler and the executor, nothing else. It takes plain requests in and
gives plain outputs back (memwall/engine/protocol.py), so it runs the same in-process (offline
``LLM``) and in a process of its own (``memwall serve``, memwall/engine/core_client.py).

    step():  scheduler.schedule()  -> SchedulerOutput   (plain data: new requests, then deltas)
             executor.execute()    -> RunnerOutput      (sampled ids, logprobs)
             scheduler.update()    -> requests that got a token (stop checks, cache, free)
             -> EngineCoreOutputs  (new tokens per sample, finish reasons, stats)

It holds no tokenizer and touches no device: text lives on the API side, tensors in the worker.
Structured-output requests wait in ``_compiling`` until their grammar is compiled (on the
StructuredOutputManager's thread), then join the scheduler with it; nobody else waits for them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from memwall.config import EngineArgs
from memwall.core.kv.manager import KVCacheManager
from memwall.core.scheduler import Scheduler
from memwall.engine.protocol import (EngineCoreInfo, EngineCoreOutput, EngineCoreOutputs,
                                     EngineCoreRequest, EngineStats)
from memwall.executor import Executor, make_executor
from memwall.request import Request, RequestStatus
from memwall.structured.backend import GrammarError
from memwall.structured.manager import PendingGrammar, StructuredOutputManager

# With nothing to run but grammars compiling, a step waits this long for one to finish
# (instead of returning at once and being called again in a busy loop).
COMPILE_WAIT_S = 0.05


@dataclass
class _Compiling:
    """A request and its n > 1 forks, each with the grammar being compiled for it."""

    samples: list[tuple[Request, PendingGrammar]]
    """The first sample, then the forks."""

    @property
    def requests(self) -> list[Request]:
        return [request for request, _ in self.samples]

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
        self.executor.init_cache(plan, sched_cfg.max_num_seqs, self.max_model_len)
        shape = None
        if args.max_num_batched_tokens is None and sched_cfg.enable_chunked_prefill:
            shape = self.executor.measure_step_shape(sched_cfg.max_num_seqs, plan.block_size)
            if shape is not None:
                sched_cfg = dataclasses.replace(sched_cfg,
                                                max_num_batched_tokens=shape.max_num_batched_tokens)
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size,
                                 args.cache_config().enable_prefix_caching, plan.num_swap_blocks)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        description = f"{plan.describe()}; context window {self.max_model_len} tokens; " + (
            shape.describe() if shape else f"step budget {sched_cfg.max_num_batched_tokens} tokens")
        device_text = self.executor.describe()
        self.info = EngineCoreInfo(model.name, self.max_model_len, model.vocab_size,
                                   sched_cfg.max_num_seqs,
                                   description + (f"; {device_text}" if device_text else ""),
                                   args.structured_outputs_backend)
        self.structured = (StructuredOutputManager(model.vocab, args.structured_outputs_backend,
                                                   warmup=args.structured_outputs_warmup)
                           if model.vocab is not None else None)
        self._compiling: list[_Compiling] = []

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None:
        """Queues one sample; ``forks`` (n > 1) share its prefill and fork its KV blocks.
        A structured-output request first waits for its grammar (compiled off the step loop)."""
        request, children = _to_request(first), [_to_request(f) for f in forks]
        constraint = first.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add(request, fork_children=children)
            return
        if self.structured is None:
            raise ValueError("this engine's model has no tokenizer vocabulary for structured outputs")
        ids = {r.request_id for r in self.scheduler.requests.values()}
        ids.update(r.request_id for c in self._compiling for r in c.requests)
        taken = next((r.request_id for r in (request, *children) if r.request_id in ids), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} is already in use")
        submit = self.structured.submit
        self._compiling.append(_Compiling([(r, submit(r.sampling_params.structured_outputs))
                                           for r in (request, *children)]))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finishes these samples wherever they are; their blocks are free before the next step."""
        gone = set(request_ids)
        for entry in self._compiling:  # a request whose first sample is aborted goes whole
            first = entry.samples[0][0]
            entry.samples = [s for s in entry.samples if s[0] is first or s[0].request_id not in gone]
        self._compiling = [c for c in self._compiling if c.samples[0][0].request_id not in gone]
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._compiling)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        failed = self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return EngineCoreOutputs(failed, stats=self.stats())
        result = self.executor.execute(sched)
        touched = self.scheduler.update(sched, result)
        return EngineCoreOutputs(failed + [_output(r) for r in touched], self.stats())

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammars are compiled join the scheduler; a grammar that failed to
        compile finishes its request ("abort", the error as stop_reason). With nothing else to
        run, waits a little for a compile rather than spin."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished:
            self._compiling[0].samples[-1][1].wait(COMPILE_WAIT_S)
        failed = []
        for entry in [c for c in self._compiling if all(p.ready for _, p in c.samples)]:
            self._compiling.remove(entry)
            first, *forks = entry.requests
            try:
                for request, pending in entry.samples:
                    request.grammar = self.structured.take(pending)
            except (GrammarError, ValueError) as e:
                logger.warning("request %s: its grammar does not compile: %s", first.request_id, e)
                for request in entry.requests:
                    request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, str(e)
                    failed.append(_output(request))
                continue
            self.scheduler.add(first, fork_children=forks)
        return failed

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv
        return EngineStats(len(scheduler.running), len(scheduler.waiting), kv.num_free_blocks,
                           kv.num_total_blocks, scheduler.num_preemptions,
                           scheduler.stats.num_preemptions_recompute,
                           scheduler.stats.num_preemptions_swap, kv.stats.queries, kv.stats.hits,
                           kv.pool.num_evictions, scheduler.stats.spec_num_draft_tokens,
                           scheduler.stats.spec_num_accepted_tokens,
                           scheduler.stats.spec_num_verify_steps)

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
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

