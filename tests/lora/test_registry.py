"""The engine core's LoRA registry with fake workers: loads are shared and queued while the
host caches are full of adapters in use, the least valuable idle adapter is dropped for a new
one (least recently used under the vllm policy), failed and abandoned loads leave nothing."""

from __future__ import annotations

import threading
import time

import pytest

from memwall.lora.adapter import LoRAError
from memwall.lora.registry import LoRARegistry
from memwall.lora.request import LoRARequest
from memwall.lora.worker_lora import AdapterInfo


class FakeWorkers:
    def __init__(self) -> None:
        self.loaded: set[int] = set()
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def add(self, lora: LoRARequest) -> AdapterInfo:
        self.gate.wait(10)
        self.calls.append(lora.lora_int_id)
        if lora.lora_path == "bad":
            raise LoRAError("adapter 'bad': no adapter_config.json")
        self.loaded.add(lora.lora_int_id)
        return AdapterInfo(lora.lora_int_id, f"hash{lora.lora_int_id}", 8, 100)

    def remove(self, lora_int_id: int) -> None:
        self.loaded.discard(lora_int_id)


def lora(i: int, path: str = "p") -> LoRARequest:
    return LoRARequest(f"a{i}", i, path)


def settle(pending, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pending.ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pending.ready


def test_requests_share_one_load_and_the_cache_key_is_the_content():
    workers = FakeWorkers()
    reg = LoRARegistry(workers.add, workers.remove, max_cpu_loras=2)
    first, second = reg.submit(lora(1), set()), reg.submit(lora(1), {1})
    assert first is second
    settle(first)
    info = reg.take(first)
    assert workers.calls == [1] and reg.cache_key(lora(1), info) == ("lora", "hash1")
    assert reg.submit(lora(1), {1}).ready  # loaded: ready at once, no second load
    vllm = LoRARegistry(workers.add, workers.remove, 2, cache_policy="vllm")
    assert vllm.cache_key(lora(1), info) == ("lora", "a1")


def test_a_full_cache_of_adapters_in_use_queues_the_next_load():
    workers = FakeWorkers()
    reg = LoRARegistry(workers.add, workers.remove, max_cpu_loras=2)
    for i in (1, 2):
        p = reg.submit(lora(i), {1, 2})
        settle(p)
        reg.take(p)
    queued = reg.submit(lora(3), {1, 2})
    time.sleep(0.05)
    assert not queued.ready and queued.future is None and workers.calls == [1, 2]
    reg.pump({2, 3})  # adapter 1's requests ended
    settle(queued)
    reg.take(queued)
    assert set(reg.loaded) == {2, 3} and workers.loaded == {2, 3} and reg.stats.evictions == 1


@pytest.mark.parametrize("policy, victim", [("adapter-aware", 2), ("vllm", 1)])
def test_the_dropped_adapter_is_the_least_asked_for_or_the_least_recent(policy, victim):
    workers = FakeWorkers()
    reg = LoRARegistry(workers.add, workers.remove, max_cpu_loras=2, cache_policy=policy)
    for i in (1, 2):
        p = reg.submit(lora(i), set())
        settle(p)
        reg.take(p)
    for _ in range(5):  # adapter 1 is popular ...
        reg.observe(1)
    reg.submit(lora(2), set())  # ... adapter 2 the most recently asked for
    p = reg.submit(lora(3), set())
    settle(p)
    reg.take(p)
    assert victim not in reg.loaded and 3 in reg.loaded


def test_failed_and_abandoned_loads_leave_nothing():
    workers = FakeWorkers()
    reg = LoRARegistry(workers.add, workers.remove, max_cpu_loras=1)
    bad = reg.submit(lora(1, "bad"), set())
    settle(bad)
    with pytest.raises(LoRAError, match="adapter_config"):
        reg.take(bad)
    assert not reg.loaded and not reg._pending
    workers.gate.clear()
    p = reg.submit(lora(2), set())  # loading ...
    q = reg.submit(lora(3), {2})  # ... and 3 queued behind it
    reg.pump(set())  # every request was aborted: the queued load is dropped
    workers.gate.set()
    settle(p)
    reg.pump(set())  # the finished load joins the cache by itself
    assert q.future is None and 3 not in reg._pending and list(reg.loaded) == [2]
    assert workers.calls == [1, 2]  # the bad one was tried once, adapter 3 never


def test_unloaded_adapters_kv_is_worth_nothing():
    workers = FakeWorkers()
    reg = LoRARegistry(workers.add, workers.remove, max_cpu_loras=2)
    p = reg.submit(lora(1), set())
    settle(p)
    key = reg.cache_key(lora(1), reg.take(p))
    assert reg.kv_value(key) > 0 and reg.kv_value(("unknown",)) == 0.0
    reg.unload(1, forever=True)
    assert reg.kv_value(key) == -1.0 and workers.loaded == set()
