"""The CPU KV cache's memory (memwall/worker/kv_cache.py _zeros): zeroed, resident only where
blocks were written, and in small pages. numpy's zeros asked for transparent huge pages, and a
first write into each 2 MiB region then stalled on a huge-page fault with compaction: 4.7 ms of
a 16-sequence decode step on a 2-core EPYC VM."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from memwall.config import ModelArchConfig
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

ARCH = ModelArchConfig.from_hf_dict(dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_hidden_layers=1,
    num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=1000,
    max_position_embeddings=4096))
BLOCKS, BLOCK = 2048, 16  # 2048 x 16 x 3 x 64 fp16 = 12 MiB a tensor: six huge pages' worth

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps"),
                                reason="reads /proc/self/smaps (Linux)")


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        fields, inside = {}, False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                if inside:
                    return fields
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside, fields = lo <= address < hi, {}
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if inside:
            return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _kib(value: str) -> int:
    return int(value.split()[0])


@linux_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float32])
def test_cache_is_zero_and_resident_only_where_written(dtype):
    (k, v), = allocate_kv_cache(ARCH, KVCachePlan(BLOCKS, BLOCK, 0), dtype)
    assert k.shape == (BLOCKS, BLOCK, 3, 64) and k.dtype == dtype and k.is_contiguous()
    assert k.data_ptr() != v.data_ptr()
    block = k[700]  # 4 MiB into the tensor (fp16): past any head of the mapping split off
    before = _kib(_mapping(block.data_ptr())["Rss"])
    assert before < 1024, f"{before} KiB resident before any write"
    block.fill_(1)  # one block: 6 KiB of fp16
    assert (k[700] == 1).all() and (k[699] == 0).all() and (k[701] == 0).all()
    grown = _kib(_mapping(block.data_ptr())["Rss"]) - before
    assert 0 < grown <= 64, f"writing one block made {grown} KiB resident (a huge page is 2048)"
    assert bool((v == 0).all()) and bool((k[:700] == 0).all())


@linux_only
def test_cache_mapping_refuses_transparent_huge_pages():
    (k, _), = allocate_kv_cache(ARCH, KVCachePlan(BLOCKS, BLOCK, 0), torch.float16)
    fields = _mapping(k[1000].data_ptr())
    if "VmFlags" not in fields:
        pytest.skip("this kernel's smaps has no VmFlags")
    assert "nh" in fields["VmFlags"].split(), fields["VmFlags"]  # MADV_NOHUGEPAGE
    k.fill_(2)  # every page written: still no huge page
    assert _kib(_mapping(k[1000].data_ptr())["AnonHugePages"]) == 0


def test_cache_outlives_every_other_reference():
    (k, _), = allocate_kv_cache(ARCH, KVCachePlan(4, BLOCK, 0), torch.bfloat16)
    view = k[1:3]
    del k
    view.fill_(3)  # the mapping is held by the tensor's storage, not by a name here
    assert bool((view == 3).all())
