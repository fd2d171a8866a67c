"""EngineCore: the scheduler and the executor, nothing else. It takes plain requests in and
gives plain outputs back (memwall/engine/protocol.py), so it runs the same in-process (offline
``LLM``) and in a process of its own (``memwall serve``, memwall/engine/core_client.py).

    step():  scheduler.schedule()  -> SchedulerOutput   (plain data: new requests, then deltas)
             executor.execute()    -> RunnerOutput      (sampled ids, logprobs)
             scheduler.update()    -> requests that got a token (stop checks, cache, free)
             -> EngineCoreOutputs  (new tokens per sample, finish reasons, stats)

It holds no tokenizer and touches no device: text lives on the API side, tensors in the worker.
"""

from __future__ import annotations

import dataclasses
import logging

from memwall.config import EngineArgs
from memwall.core.kv.manager import KVCacheManager
from memwall.core.scheduler import Scheduler
from memwall.engine.protocol import (EngineCoreInfo, EngineCoreOutput, EngineCoreOutputs,
                                     EngineCoreRequest, EngineStats)
from memwall.executor import Executor, make_executor
from memwall.request import Request

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
                                   description + (f"; {device_text}" if device_text else ""))

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None:
        """Queues one sample; ``forks`` (n > 1) share its prefill and fork its KV blocks."""
        self.scheduler.add(_to_request(first), fork_children=[_to_request(f) for f in forks])

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finishes these samples wherever they are; their blocks are free before the next step."""
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return EngineCoreOutputs(stats=self.stats())
        result = self.executor.execute(sched)
        touched = self.scheduler.update(sched, result)
        return EngineCoreOutputs([_output(r) for r in touched], self.stats())

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

