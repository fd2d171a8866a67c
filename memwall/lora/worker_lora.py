"""WorkerLoRA: the worker's adapters. A host cache of loaded adapters (by ``lora_int_id``, filled
and emptied by the engine core's registry) and ``max_loras`` compute slots (LoRASlots), filled
from the host cache on demand and reused least recently used first.

    engine core  ── add(LoRARequest) ──>  read + check the files  ->  host cache[id]
    each step:   prepare(lora id per token)  ->  slot per token (loading slots as needed)

The scheduler never puts more than ``max_loras`` adapters in one step, so a step's adapters
always fit the slots; the slots the step does not use are the ones replaced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from memwall.config import ModelArchConfig
from memwall.lora.adapter import LoRAAdapter, LoRAError
from memwall.lora.peft import load_adapter
from memwall.lora.request import LoRARequest
from memwall.lora.slots import LoRASlots


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine core learns of a loaded adapter (plain data)."""

    lora_int_id: int
    content_hash: str
    rank: int
    nbytes: int


class WorkerLoRA:
    def __init__(self, arch: ModelArchConfig, max_loras: int, max_rank: int,
                 base_config: dict | None = None) -> None:
        self.slots = LoRASlots(arch, max_loras, max_rank)
        self.base_config = base_config
        self.host: dict[int, LoRAAdapter] = {}
        self._lock = threading.Lock()  # add/remove come from the core's loader thread
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        """lora id -> slot, least recently used first."""
        self.num_slot_loads = 0

    def add(self, lora: LoRARequest) -> AdapterInfo:
        """Reads and checks the adapter (LoRAError says what is wrong) into the host cache."""
        adapter = load_adapter(lora.lora_path, lora.lora_name, self.base_config)
        self.slots.check(adapter)
        with self._lock:
            self.host[lora.lora_int_id] = adapter
        return AdapterInfo(lora.lora_int_id, adapter.content_hash, adapter.rank, adapter.nbytes)

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self.host.pop(lora_int_id, None)
            slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots.clear(slot)

    def prepare(self, token_lora_ids: list[int]) -> None:
        """Sets the step's slot per token (lora id 0: none), loading adapters into slots."""
        used = sorted({i for i in token_lora_ids if i})
        if not used:
            self.slots.set_step(None)
            return
        if len(used) > self.slots.max_loras:
            raise ValueError(f"a step with {len(used)} adapters; max_loras is {self.slots.max_loras}")
        for lora_id in used:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            self._load_slot(lora_id, set(used))
        self.slots.set_step([self.slot_of[i] if i else -1 for i in token_lora_ids])

    def _load_slot(self, lora_id: int, in_step: set[int]) -> None:
        with self._lock:
            adapter = self.host.get(lora_id)
        if adapter is None:
            raise LoRAError(f"adapter id {lora_id} is not loaded on this worker")
        taken = set(self.slot_of.values())
        free = [s for s in range(self.slots.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter that this step does not need
            victim = next(i for i in self.slot_of if i not in in_step)
            slot = self.slot_of.pop(victim)
        self.slots.load(slot, adapter)
        self.slot_of[lora_id] = slot
        self.num_slot_loads += 1
