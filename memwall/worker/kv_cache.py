"""Sizing and allocating the paged KV cache tensors."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from memwall.attention import kv_quant
from memwall.config import CacheConfig, ModelArchConfig


def bytes_per_token(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in the cache's format (int8's scales included)."""
    per_head = kv_quant.bytes_per_token_head(dtype, arch.head_dim)
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * per_head


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens."""
    return block_size * bytes_per_token(arch, dtype)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); falls back to 4 GiB elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    num_swap_blocks: int = 0
    """Blocks of the secondary (host) pool that swap preemption parks KV in."""
    kv_dtype: str = ""
    """The cache's format (memwall/attention/kv_quant.py name), for the start-up line."""

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def describe(self) -> str:
        fmt = f"{self.kv_dtype}, " if self.kv_dtype else ""
        text = (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.max_tokens} tokens, {self.total_bytes / 2**20:.1f} MiB "
                f"({fmt}{self.bytes_per_token} bytes/token)")
        if self.num_swap_blocks:
            text += f"; swap pool {self.num_swap_blocks} blocks"
        return text


def plan_kv_cache(arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype,
                  max_useful_tokens: int | None) -> KVCachePlan:
    """Blocks from an explicit count, a byte budget, or a fraction of free memory.

    A budget larger than ``max_useful_tokens`` (all sequences at full context) is trimmed to
    it; None: the whole budget. Blocks past that many tokens only hold cached prefixes of
    finished requests, so the worker trims the budget it chose (a fraction of free RAM: most of
    it would sit zeroed) and keeps one the user gave (``kv_cache_memory``), as vLLM keeps its
    KV cache space: a batch-1 engine given 1 GiB kept 180 MiB, 8,192 tokens, and 24 grounded
    prompts of ~400 tokens evicted one another from its prefix cache on every pass.
    """
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    num_swap = cache.swap_space // per_block
    name = kv_quant.name_of(dtype)
    if cache.num_blocks is not None:
        return KVCachePlan(cache.num_blocks, cache.block_size, per_block, num_swap, name)
    budget = cache.kv_cache_memory
    if budget is None:
        budget = int(available_memory_bytes() * cache.kv_cache_fraction)
    num_blocks = budget // per_block
    if max_useful_tokens is not None:
        num_blocks = min(num_blocks, -(-max_useful_tokens // cache.block_size))
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {per_block} bytes: "
                         "raise --kv-cache-memory")
    return KVCachePlan(int(num_blocks), cache.block_size, per_block, num_swap, name)


def allocate_kv_cache(arch: ModelArchConfig, plan: KVCachePlan, dtype: torch.dtype,
                      device: torch.device | str = "cpu", num_blocks: int | None = None,
                      pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv_heads, head_dim], zeroed;
    an int8 cache carries its scales [num_blocks, block_size, kv_heads] (kv_quant.py).

    Zeroed rather than empty: padded decode batches read unused slots (masked out), and masked
    garbage that happens to be NaN would still poison the softmax-weighted sum.
    ``pin_memory``: page-locked host memory (the swap pool of a GPU engine, so block copies
    to and from the device can be asynchronous); only with device "cpu".
    """
    count = plan.num_blocks if num_blocks is None else num_blocks
    shape = (count, plan.block_size, arch.num_key_value_heads, arch.head_dim)
    zeros = _pinned_zeros if pin_memory else _zeros

    def make(size: tuple[int, ...], elem: torch.dtype) -> torch.Tensor:
        return zeros(size, elem, device)

    return [(kv_quant.allocate(shape, dtype, make), kv_quant.allocate(shape, dtype, make))
            for _ in range(arch.num_hidden_layers)]


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        raise ValueError(f"pinned memory is host memory; got device {device}")
    return torch.zeros(shape, dtype=_storage_dtype(dtype), pin_memory=True).view(dtype)


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Fill as uint8 where a 1-byte float type (fp8) may lack a fill kernel: zero is zero."""
    return torch.uint8 if torch.empty((), dtype=dtype).element_size() == 1 else dtype


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed memory that costs nothing until it is touched, in small pages.

    On CPU, torch.zeros writes every byte up front (seconds for a multi-GB cache, and all of it
    resident at once). A private anonymous mapping is zero-filled by the kernel page by page as
    blocks are first written, so the cache grows in RSS only as blocks are really used. Not
    numpy's zeros: it asks for transparent huge pages on arrays of 4 MiB and more, and where THP
    is "madvise" (Ubuntu's default, and these VMs') each first write to a 2 MiB region then
    stalls on a huge-page fault with direct compaction. Measured on a 2-core EPYC: a 16-sequence
    decode step spent 4.7 ms writing its new K/V rows (0.9 ms in small pages), 13% of the step
    (README, session 24).
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=_storage_dtype(dtype), device=device).view(dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[elem])
        return torch.from_numpy(raw).view(dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where THP is "always"
        region.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds a reference to the mapping: it lives as long as the cache does
    storage = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[elem]
    return torch.frombuffer(region, dtype=storage).view(shape).view(dtype)
