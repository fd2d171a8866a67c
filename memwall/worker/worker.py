"""Worker: one model replica on one device. The engine core talks to it only through the
executor, with plain data: it never sees the model, the device or a tensor.

    load_model()            -> ModelInfo (name, architecture)
    determine_num_blocks()  -> KVCachePlan (free RAM on the CPU, a profiled pass on a GPU)
    init_cache(plan)        -> KV tensors allocated, CUDA graphs captured / CPU kernels built
    measure_step_shape()    -> StepShape (the CPU step budget from measured kernel speed)
    execute(SchedulerOutput) -> RunnerOutput
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memwall.attention import kv_quant
from memwall.config import CacheConfig, EngineArgs, ModelArchConfig, SchedulerConfig
from memwall.core.step import RunnerOutput, SchedulerOutput
from memwall.layers.rotary import RotaryEmbedding
from memwall.loader.model_loader import LoadedModel, load_model
from memwall.structured.vocab import VocabInfo
from memwall.worker.device import (GpuMemoryProfile, kv_cache_dtype, loader_quantization,
                                   place_model, profile_gpu_memory)
from memwall.worker.kv_cache import KVCachePlan, plan_kv_cache
from memwall.worker.runner import ModelRunner
from memwall.worker.step_shape import StepShape, measure as measure_step_shape

if TYPE_CHECKING:
    from memwall.distributed.communicator import Communicator
    from memwall.distributed.pipeline import PipeEnds, PipelineStage
    from memwall.executor.rank import Reply
    from memwall.lora.worker_lora import WorkerLoRA

logger = logging.getLogger("memwall")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    arch: ModelArchConfig
    vocab: VocabInfo | None = None
    """The tokenizer's tokens, for structured outputs' grammars (compiled in the engine core)."""
    device: str = "cpu"
    """Where the worker runs the model: cpu or cuda."""

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def max_len(self) -> int:
        """The longest context the model supports (a uniform sliding window, if it has one:
        windows per layer, as Gemma's, are attended natively)."""
        model_len = self.arch.max_position_embeddings
        if self.arch.context_cap:
            model_len = min(model_len, self.arch.context_cap)
        return model_len


class Worker:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 tp_comm: "Communicator | None" = None, stage: tuple[int, int] = (0, 1)) -> None:
        """``loaded``: a model already in memory (tests, benchmarks); else ``args.model`` loads.
        ``tp_comm``: this rank's tensor-parallel group, ``stage``: (index, stages) of its
        pipeline stage (memwall/distributed): the model is cut to the rank's share after
        loading."""
        self.args = args
        self.tp_comm = tp_comm
        self.stage_index, self.num_stages = stage
        self.busy_s = 0.0
        self.stage: "PipelineStage | None" = None
        self.pipe: "PipeEnds | None" = None
        self.arch: ModelArchConfig | None = None
        """The model's shape as this worker holds it (a tensor-parallel rank's heads, KV heads
        and MLP columns): what its KV cache and kernels are sized by."""
        self.device_config = args.device_config(torch.cuda.is_available())
        self.loaded = loaded
        self.owns_model = loaded is None
        """The model is this worker's alone (not handed in, where other engines may share it)."""
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.gpu_memory: GpuMemoryProfile | None = None
        self.draft: LoadedModel | None = None
        self.lora = None

    def load_model(self) -> ModelInfo:
        torch.set_num_threads(self.args.threads or default_threads())
        dev = self.device_config
        if self.loaded is None:
            part = None
            if self.num_stages > 1:  # a pipeline stage reads only its own layers' tensors
                from memwall.distributed.pipeline import stage_tensors
                part = stage_tensors(self.stage_index, self.num_stages)
            tp = None
            # a rank reads only its slice; fp8 scales each whole row after loading: cut after
            if self.tp_comm is not None and self.tp_comm.size > 1 and self.args.quantization != "fp8":
                from memwall.distributed.tensor_parallel import rank_layout
                tp = rank_layout(self.tp_comm.rank, self.tp_comm.size)
            self.loaded = load_model(self.args.model, dev.dtype, self.args.tokenizer,
                                     progress=self.args.show_progress,
                                     quantization=loader_quantization(self.args.quantization),
                                     part=part, tensor_parallel=tp)
        self.model = place_model(self.loaded.model, dev, self.args.quantization)
        self.arch = self.loaded.arch
        if self.num_stages > 1:
            from memwall.distributed.pipeline import cut_stage, stage_of
            self.stage = stage_of(self.stage_index, self.num_stages, self.arch)
            self.arch = cut_stage(self.model, self.stage)
            if self.pipe is not None:
                self.pipe.stage = self.stage
        if self.tp_comm is not None and self.tp_comm.size > 1:
            from memwall.distributed.tensor_parallel import shard_model
            self.arch = shard_model(self.model, self.tp_comm)
        self._pack(self.model)
        self._load_draft_model()
        tokenizer = self.loaded.tokenizer
        vocab = VocabInfo(tokenizer.backend, self.loaded.arch.vocab_size,
                          tuple(sorted(tokenizer.eos_token_ids)))
        return ModelInfo(self.loaded.name, self.loaded.arch, vocab,
                         "cuda" if dev.is_cuda else "cpu")

    def _load_draft_model(self) -> None:
        """The drafter of ``"method": "draft_model"``, loaded as the target is, its tokenizer
        checked against the target's (drafts are the target's token ids)."""
        spec = self.args.speculative()
        if spec is None or spec.method != "draft_model" or self.draft is not None:
            return
        from memwall.spec_decode.draft_model import check_tokenizers

        dev = self.device_config
        draft = load_model(spec.model, dev.dtype, progress=self.args.show_progress,
                           quantization=loader_quantization(self.args.quantization),
                           requantize=spec.requantize)
        check_tokenizers(self.loaded.tokenizer, draft.tokenizer, draft.name)
        self.draft = dataclasses.replace(draft, model=place_model(draft.model, dev,
                                                                  self.args.quantization))
        self._pack(self.draft.model)

    def _pack(self, model: torch.nn.Module) -> None:
        """q4/q8 weights into 16-row panels on CPUs with AVX-512 VNNI (memwall/quant/packing.py),
        once the model has its final shape."""
        if self.device_config.is_cuda:
            return
        from memwall.quant.packing import pack_model
        report = pack_model(model)
        if report.layers:
            logger.info("weights: %s", report.summary())

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig) -> KVCachePlan:
        """The KV pool: on cuda without an explicit size, what a profiled forward pass leaves of
        gpu_memory_utilization x the device's memory; elsewhere the configured budget."""
        dev, arch, kv_dtype = self.device_config, self.arch, kv_cache_dtype(self.device_config)
        given = cache.kv_cache_memory is not None  # the user's bytes are all used (plan_kv_cache)
        ranks = self.args.parallel_config().world_size
        if ranks > 1 and cache.num_blocks is None:  # the budget is the host's: ranks share it
            cache = (dataclasses.replace(cache, kv_cache_memory=cache.kv_cache_memory // ranks)
                     if cache.kv_cache_memory is not None else
                     dataclasses.replace(cache, kv_cache_fraction=cache.kv_cache_fraction / ranks))
        if dev.is_cuda and cache.kv_cache_memory is None and cache.num_blocks is None:
            from memwall.attention.backend import choose as choose_backend
            self.gpu_memory = profile_gpu_memory(self.model, arch, sched, cache.block_size,
                                                 kv_dtype, dev, choose_backend(dev.device))
            cache = dataclasses.replace(cache, kv_cache_memory=self.gpu_memory.check())
        return plan_kv_cache(arch, cache, kv_dtype,
                             None if given else sched.max_num_seqs * sched.max_model_len)

    def init_cache(self, plan: KVCachePlan, max_num_seqs: int, max_model_len: int) -> None:
        dev = self.device_config
        if self.owns_model:  # rotary tables as long as the context window, no more
            for module in self.model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.truncate(max_model_len)
        self.lora = self._make_lora()
        self.runner = ModelRunner(self.model, self.arch, plan, kv_cache_dtype(dev),
                                  self.args.seed, dev, max_num_seqs, max_model_len,
                                  self.args.speculative(), self.draft, self.lora)
        if self.lora is not None:
            self.lora.kv_caches = self.runner.kv_caches
        self.runner.pipe = self.pipe

    # ---- pipeline parallel: connecting the stages (before load_model) ----
    def open_pipe_out(self):
        """The ring this rank sends its hidden states to the next stage through; returns the
        handle the next stage's rank connects with (None on the last stage)."""
        from memwall.distributed.pipeline import PipeEnds, StagePipe
        timeout = self.args.parallel_config().comm_timeout_s
        self.pipe = self.pipe or PipeEnds(None, timeout_s=timeout)
        if self.stage_index == self.num_stages - 1:
            return None
        self.pipe.outgoing = StagePipe.open_sender()
        return self.pipe.outgoing.handle()

    def connect_pipe_in(self, handles: list) -> None:
        """``handles[rank]``: every rank's ``open_pipe_out`` answer; this rank reads from the
        same tensor-parallel rank of the stage before."""
        from memwall.distributed.pipeline import StagePipe
        if self.stage_index > 0:
            tp = self.args.parallel_config().tensor_parallel_size
            tp_rank = self.tp_comm.rank if self.tp_comm is not None else 0
            self.pipe.incoming = StagePipe.connect(handles[(self.stage_index - 1) * tp + tp_rank])

    def use_handoff_pipe(self) -> None:
        """Stage boundaries as call arguments and return values (``execute_stage``), for
        executors whose ranks may sit on other hosts (Ray)."""
        from memwall.distributed.pipeline import Handoff, PipeEnds
        first, last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.pipe = PipeEnds(self.stage, None if first else Handoff(), None if last else Handoff())

    def execute_stage(self, sched: SchedulerOutput, previous: "Reply | None" = None):
        """One step of this pipeline stage with ``use_handoff_pipe``: ``previous`` is the stage
        before's reply (its hidden states); returns this stage's hidden states for the next
        one, or on the last stage the step's RunnerOutput."""
        if self.pipe.incoming is not None:
            if previous is None or not previous.ok:
                why = "no input" if previous is None else previous.error.splitlines()[0]
                raise RuntimeError(f"pipeline stage {self.stage_index - 1} failed: {why}")
            self.pipe.incoming.value = previous.value
        out = self.execute(sched)
        return self.pipe.outgoing.receive() if self.pipe.outgoing is not None else out

    def _make_lora(self) -> "WorkerLoRA | None":
        """With --enable-lora: slots for max_loras adapters, the model's projections wrapped
        to add their deltas (before the runner describes the model to the fused CPU step)."""
        if not self.args.enable_lora:
            return None
        from memwall.lora.layers import apply_lora
        from memwall.lora.slots import base_config
        from memwall.lora.worker_lora import WorkerLoRA

        if self.device_config.is_cuda:
            raise ValueError("LoRA serving runs on the CPU backend for now (--device cpu)")
        lora = WorkerLoRA(self.loaded.arch, self.args.max_loras, self.args.max_lora_rank,
                          base_config(self.loaded.arch))
        apply_lora(self.model, lora.slots)
        return lora

    def add_lora(self, lora_request):
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (--enable-lora)")
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def park_lora(self, lora_int_id: int, block_ids: list[int]) -> None:
        self.lora.park(lora_int_id, block_ids)

    def measure_step_shape(self, max_num_seqs: int, block_size: int) -> StepShape | None:
        """The CPU step budget from this machine's measured kernel speed (step_shape.py); None
        on cuda."""
        if self.device_config.is_cuda:
            return None
        return measure_step_shape(self.model, max_num_seqs, block_size)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        try:
            return self.runner.execute(sched)
        finally:
            self.busy_s += time.perf_counter() - start

    def busy_seconds(self) -> float:
        """Seconds this worker has computed steps (not counting a pipeline stage's waits for
        the stage before): 1 - busy / wall is its idle share, the pipeline's bubble."""
        return self.busy_s - (self.pipe.wait_s if self.pipe is not None else 0.0)

    def describe(self) -> str:
        """The device half of the start-up line."""
        dev = self.device_config
        parts = [self.runner.describe()] if self.runner is not None else []
        kv_name = kv_quant.name_of(kv_cache_dtype(dev))  # auto resolved: what the cache holds
        parts.append(f"KV cache {kv_name}" + (" (auto)" if dev.kv_cache_dtype == "auto" else ""))
        if self.gpu_memory is not None:
            parts.append(self.gpu_memory.describe())
        return "; ".join(p for p in parts if p)

    def layout(self) -> str:
        """This rank's share of the model: its pipeline stage and tensor-parallel shard."""
        parts = []
        if self.stage is not None:
            parts.append(self.stage.describe())
        if self.tp_comm is not None and self.tp_comm.size > 1:
            parts.append(self.model.tp_shard.describe())
        return ", ".join(parts)


def default_threads() -> int:
    """The cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
