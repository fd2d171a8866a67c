"""WorkerLoRA: the worker's adapters. A host cache of loaded adapters (by ``lora_int_id``, filled
and emptied by the engine core's registry) and ``max_loras`` compute slots (LoRASlots), filled
from the host cache on demand and reused least recently used first.

    engine core  ── add(LoRARequest) ──>  read + check the files  ->  host cache[id]
    each step:   prepare(lora id per token)  ->  slot per token (loading slots as needed)

The scheduler never puts more than ``max_loras`` adapters in one step, so a step's adapters
always fit the slots; the slots the step does not use are the ones replaced.

The unified pool (``lora_cache_policy="adapter-aware"``): the engine core gives a loaded
adapter KV blocks of its own and the worker parks the weights there (``park``), as S-LoRA's
unified paging does: adapters and KV share one memory budget, and the core's pool decides
which of them to drop. A slot load reads a parked adapter back from its blocks.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from memwall.config import ModelArchConfig
from memwall.lora.adapter import LoRAAdapter, LoRAError, LoRAWeights
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
    park_blocks: int = 0
    """KV blocks its weights fill when parked in the KV cache (0: the worker cannot park)."""
    load_s: float = 0.0
    """Seconds its load from disk took (what dropping it from the host cache costs again)."""


@dataclass
class ParkedAdapter:
    """An adapter whose weights live in KV-cache blocks (the unified pool): its A and B of every
    module, in order, as float32 bytes written across the blocks' per-layer K and V slabs."""

    name: str
    path: str
    content_hash: str
    rank: int
    shapes: list[tuple[str, tuple[int, int], tuple[int, int]]]
    """(module, A shape, B shape), in storage order."""
    block_ids: list[int]


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
        self.kv_caches: list = []
        """The KV cache tensors adapters may be parked in (set once the cache exists)."""

    def add(self, lora: LoRARequest) -> AdapterInfo:
        """Reads and checks the adapter (LoRAError says what is wrong) into the host cache."""
        start = time.perf_counter()
        adapter = load_adapter(lora.lora_path, lora.lora_name, self.base_config)
        self.slots.check(adapter)
        with self._lock:
            self.host[lora.lora_int_id] = adapter
        slab = self._slab_bytes()
        blocks = -(-adapter.nbytes // slab) if slab else 0
        return AdapterInfo(lora.lora_int_id, adapter.content_hash, adapter.rank, adapter.nbytes,
                           blocks, time.perf_counter() - start)

    # ---- the unified pool: adapters parked in KV blocks -------------------------------------
    def _slab_bytes(self) -> int:
        """Bytes one KV block holds over all layers' K and V (scales not counted)."""
        if not self.kv_caches:
            return 0
        k, v = self.kv_caches[0]
        per_layer = k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
        return per_layer * len(self.kv_caches)

    def _copy_slabs(self, block_ids: list[int], data: torch.Tensor, into_blocks: bool) -> int:
        """Copies the bytes ``data`` into (or out of) the blocks' K and V slabs, block by block
        and layer by layer; returns how many bytes the blocks held of it."""
        offset = 0
        for block in block_ids:
            for k, v in self.kv_caches:
                for cache in (k, v):
                    if offset >= data.numel():
                        return offset
                    slab = cache[block].reshape(-1).view(torch.uint8)
                    count = min(slab.numel(), data.numel() - offset)
                    if into_blocks:
                        slab[:count].copy_(data[offset:offset + count])
                    else:
                        data[offset:offset + count].copy_(slab[:count])
                    offset += count
        return offset

    def park(self, lora_int_id: int, block_ids: list[int]) -> None:
        """Moves a host-cached adapter's weights into these KV blocks (given to it by the
        engine core's pool; no sequence reads or writes them while it holds them)."""
        with self._lock:
            adapter = self.host[lora_int_id]
        if isinstance(adapter, ParkedAdapter):
            return
        parts = []
        shapes = []
        for module, w in sorted(adapter.modules.items()):
            parts += [w.a.reshape(-1), w.b.reshape(-1)]
            shapes.append((module, tuple(w.a.shape), tuple(w.b.shape)))
        data = torch.cat(parts).view(torch.uint8)
        offset = self._copy_slabs(block_ids, data, into_blocks=True)
        if offset < data.numel():
            raise ValueError(f"{len(block_ids)} KV blocks hold {offset} of the adapter's "
                             f"{data.numel()} bytes")
        parked = ParkedAdapter(adapter.name, adapter.path, adapter.content_hash, adapter.rank,
                               shapes, list(block_ids))
        with self._lock:
            self.host[lora_int_id] = parked

    def _unpark(self, parked: ParkedAdapter) -> LoRAAdapter:
        """The adapter read back from its KV blocks (exactly the bytes parked)."""
        total = sum(4 * (a[0] * a[1] + b[0] * b[1]) for _, a, b in parked.shapes)
        data = torch.empty(total, dtype=torch.uint8)
        self._copy_slabs(parked.block_ids, data, into_blocks=False)
        values = data.view(torch.float32)
        modules, at = {}, 0
        for module, a_shape, b_shape in parked.shapes:
            a_size, b_size = a_shape[0] * a_shape[1], b_shape[0] * b_shape[1]
            modules[module] = LoRAWeights(values[at:at + a_size].view(a_shape),
                                          values[at + a_size:at + a_size + b_size].view(b_shape))
            at += a_size + b_size
        return LoRAAdapter(parked.name, parked.path, parked.content_hash, parked.rank, modules)

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
        if isinstance(adapter, ParkedAdapter):
            adapter = self._unpark(adapter)
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
