"""Executor: the engine core's one handle on its workers.

Every method takes and returns plain data (configs, ``SchedulerOutput``, ``RunnerOutput``),
so an executor whose workers live in other processes can forward the same calls.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from memwall.config import CacheConfig, EngineArgs, SchedulerConfig
from memwall.core.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # the worker side imports torch; the core does not need it to type-check
    from memwall.worker.kv_cache import KVCachePlan
    from memwall.worker.step_shape import StepShape
    from memwall.worker.worker import ModelInfo


class RankFailed(RuntimeError):
    """A worker rank died, raised, or hung past the timeout: its group can run no more steps
    (the engine core ends the in-flight requests; the executor can be restarted)."""


class Executor(ABC):
    @abstractmethod
    def load_model(self) -> "ModelInfo":
        """Loads the model on every worker; returns its name and architecture."""

    @abstractmethod
    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig) -> "KVCachePlan":
        """How many KV blocks fit (the smallest answer over all workers)."""

    @abstractmethod
    def init_cache(self, plan: "KVCachePlan", max_num_seqs: int, max_model_len: int) -> None:
        """Allocates the KV cache and prepares the step (CUDA graphs, CPU kernels)."""

    def measure_step_shape(self, max_num_seqs: int, block_size: int) -> "StepShape | None":
        """The step budget measured on the (driver) worker's kernels; None where not measured."""
        return None

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Runs one step on every worker; returns the (driver worker's) sampled tokens."""

    pipeline_depth: int = 1
    """Steps the workers can run at once: one per pipeline stage (the engine core keeps that
    many in flight, each of other requests, so no stage waits for the others)."""

    def submit(self, sched: SchedulerOutput) -> None:
        """Starts a step; ``collect`` returns the results of the steps in submission order.
        Executors without a pipeline run it when collected."""
        self.__dict__.setdefault("_submitted", collections.deque()).append(sched)

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's RunnerOutput (waits for it)."""
        return self.execute(self.__dict__["_submitted"].popleft())

    def add_lora(self, lora):
        """Loads a LoRA adapter (memwall.lora.LoRARequest) into every worker's host cache;
        returns its AdapterInfo, or raises LoRAError. Called from the registry's thread."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> None:
        """Drops an adapter from every worker."""

    def park_lora(self, lora_int_id: int, block_ids: list[int]) -> None:
        """Moves a loaded adapter's weights into these KV blocks on every worker."""
        raise NotImplementedError(f"{type(self).__name__} does not park LoRA adapters")

    def describe(self) -> str:
        return ""

    def shutdown(self) -> None:
        pass


def make_executor(args: EngineArgs) -> Executor:
    """The executor ``args`` ask for (``ParallelConfig.backend``: uni, mp or ray)."""
    backend = args.parallel_config().backend()
    if backend == "mp":
        from memwall.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor(args)
    if backend == "ray":
        from memwall.executor.ray_executor import RayExecutor
        return RayExecutor(args)
    from memwall.executor.uniproc import UniProcExecutor
    return UniProcExecutor(args)
