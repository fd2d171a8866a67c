"""LLMEngine: the synchronous engine shared by the offline API, the CLI and the server.

    add_request -> Processor (tokenize, validate, fan out n) -> Scheduler queue
    step():  scheduler.schedule() -> runner.execute() -> scheduler.update()
             -> output processor (detokenize, stop strings) -> RequestOutputs
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from memwall.attention.backend import choose as choose_attention_backend
from memwall.config import CacheConfig, DeviceConfig, EngineArgs, ModelArchConfig, SchedulerConfig
from memwall.core.kv.manager import KVCacheManager
from memwall.core.scheduler import Scheduler
from memwall.engine.output_processor import OutputProcessor
from memwall.engine.processor import InvalidRequestError, Processor, PromptType
from memwall.loader.model_loader import LoadedModel, load_model
from memwall.outputs import RequestOutput
from memwall.request import Request, RequestStatus
from memwall.sampling_params import SamplingParams
from memwall.worker.device import (GpuMemoryProfile, kv_cache_dtype, loader_quantization,
                                   place_model, profile_gpu_memory)
from memwall.worker.kv_cache import plan_kv_cache
from memwall.worker.runner import ModelRunner

logger = logging.getLogger("memwall")


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel) -> None:
        self.args = args
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        arch = loaded.arch
        model_len = arch.max_position_embeddings
        if arch.sliding_window:
            model_len = min(model_len, arch.sliding_window)
        sched_cfg = args.scheduler_config(model_len)
        self.device_config = dev = args.device_config(torch.cuda.is_available())
        model = place_model(loaded.model, dev, args.quantization)
        backend = choose_attention_backend(dev.device)
        kv_dtype = kv_cache_dtype(dev)
        cache_cfg, self.gpu_memory = self._size_gpu_cache(args.cache_config(), dev, model, arch,
                                                          sched_cfg, kv_dtype, backend)
        self.kv_plan = plan_kv_cache(arch, cache_cfg, kv_dtype,
                                     sched_cfg.max_num_seqs * sched_cfg.max_model_len)
        self.max_model_len = min(sched_cfg.max_model_len, self.kv_plan.max_tokens)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, self.kv_plan.block_size,
                                 cache_cfg.enable_prefix_caching, self.kv_plan.num_swap_blocks)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.runner = ModelRunner(model, arch, self.kv_plan, kv_dtype, args.seed, dev.device, backend)
        self.graph_buckets: list[int] = []
        if dev.is_cuda and not dev.enforce_eager and backend == "triton":
            self.graph_buckets = self.runner.capture_cuda_graphs(sched_cfg.max_num_seqs,
                                                                 self.max_model_len)
        self.processor = Processor(self.tokenizer, self.max_model_len, arch.vocab_size,
                                   sched_cfg.max_num_seqs)
        self.outputs = OutputProcessor(self.tokenizer)
        self._aborted: list[Request] = []
        logger.info("%s: %s", self.model_name, self.describe())

    @classmethod
    def from_args(cls, args: EngineArgs) -> "LLMEngine":
        torch.set_num_threads(args.threads or default_threads())
        dev = args.device_config(torch.cuda.is_available())
        loaded = load_model(args.model, dev.dtype, args.tokenizer, progress=args.show_progress,
                            quantization=loader_quantization(args.quantization))
        return cls(args, loaded)

    @staticmethod
    def _size_gpu_cache(cache_cfg: CacheConfig, dev: DeviceConfig, model: torch.nn.Module,
                        arch: ModelArchConfig, sched_cfg: SchedulerConfig, kv_dtype: torch.dtype,
                        backend: str) -> tuple[CacheConfig, GpuMemoryProfile | None]:
        """On cuda without an explicit size, the KV budget is what a profiled forward pass
        leaves of gpu_memory_utilization x the device's memory."""
        if not dev.is_cuda or cache_cfg.kv_cache_memory is not None or cache_cfg.num_blocks is not None:
            return cache_cfg, None
        profile = profile_gpu_memory(model, arch, sched_cfg, cache_cfg.block_size, kv_dtype, dev,
                                     backend)
        return dataclasses.replace(cache_cfg, kv_cache_memory=profile.check()), profile

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def vocab_size(self) -> int:
        return self.loaded.arch.vocab_size

    def describe(self) -> str:
        dev = self.device_config
        text = f"{self.kv_plan.describe()}; context window {self.max_model_len} tokens"
        if dev.is_cuda:
            text += f"; cuda {dev.dtype}"
        if dev.kv_cache_dtype != "auto":
            text += f", KV cache {dev.kv_cache_dtype}"
        if self.gpu_memory is not None:
            text += f"; {self.gpu_memory.describe()}"
        if dev.is_cuda:
            text += (f"; CUDA graphs for decode batches {self.graph_buckets}" if self.graph_buckets
                     else "; eager (no CUDA graphs)")
        return text

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> list[int]:
        """Queues a request; returns its prompt token ids. Raises InvalidRequestError on bad input."""
        if request_id in self.outputs.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.processor.tokenize(prompt)
        children = self.processor.make_requests(request_id, prompt_ids, params)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, children)
        # Samples 2..n fork the first one's KV once its prompt is done (no second prefill).
        self.scheduler.add(children[0], fork_children=children[1:])
        return prompt_ids

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all of its samples) wherever it is; its blocks are freed at once."""
        for child in self.outputs.children(request_id):
            if not child.is_finished:
                self.scheduler.abort(child.request_id)
                self.runner.release(child.request_id)
                self._aborted.append(child)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: list[Request] = self._take_aborted()
        if not sched.is_empty:
            result = self.runner.execute(sched)
            updated = self.scheduler.update(sched, result)
            self._stamp_first_tokens(updated)
            for request in self.outputs.detokenize(updated):
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            touched.extend(updated)
        for request in touched:
            if request.is_finished:
                self.runner.release(request.request_id)
        return self.outputs.make_outputs(touched)

    def _take_aborted(self) -> list[Request]:
        aborted, self._aborted = self._aborted, []
        return aborted

    @staticmethod
    def _stamp_first_tokens(updated: list[Request]) -> None:
        now = time.monotonic()
        for request in updated:
            if request.first_token_time is None:
                request.first_token_time = now

    # ---- introspection (metrics, tests) ----------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv.num_total_blocks


def default_threads() -> int:
    """The cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
