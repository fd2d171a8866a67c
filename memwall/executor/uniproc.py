"""UniProcExecutor: one Worker in the engine core's own process (no copies, no pickling)."""

from __future__ import annotations

from memwall.config import CacheConfig, EngineArgs, SchedulerConfig
from memwall.core.step import RunnerOutput, SchedulerOutput
from memwall.executor.base import Executor


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs, loaded=None) -> None:
        """``loaded``: a LoadedModel already in memory (tests, benchmarks)."""
        from memwall.worker.worker import Worker

        self.worker = Worker(args, loaded)

    def load_model(self):
        return self.worker.load_model()

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig):
        return self.worker.determine_num_blocks(cache, sched)

    def init_cache(self, plan, max_num_seqs: int, max_model_len: int) -> None:
        self.worker.init_cache(plan, max_num_seqs, max_model_len)

    def measure_step_shape(self, max_num_seqs: int, block_size: int):
        return self.worker.measure_step_shape(max_num_seqs, block_size)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute(sched)

    def add_lora(self, lora):
        return self.worker.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self.worker.remove_lora(lora_int_id)

    def park_lora(self, lora_int_id: int, block_ids: list[int]) -> None:
        self.worker.park_lora(lora_int_id, block_ids)

    def describe(self) -> str:
        return self.worker.describe()
