"""Multi-LoRA in the core: at most max_loras adapters run at once, requests of other adapters
wait without blocking those behind them; the KV pool's adapter-aware eviction."""

from memwall.config import SchedulerConfig
from memwall.core.kv.block_pool import BlockPool
from memwall.core.kv.manager import KVCacheManager
from memwall.core.scheduler import Scheduler
from tests.core.test_scheduler import fake_step, req


def lora_scheduler(max_loras, max_seqs=8):
    kv = KVCacheManager(64, 4)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs, max_model_len=1024,
                          max_loras=max_loras)
    return Scheduler(cfg, kv)


def lora_req(rid, lora_id, prompt_len=5, max_tokens=3):
    r = req(rid, prompt_len, max_tokens)
    r.lora_id = lora_id
    return r


def test_a_step_never_runs_more_adapters_than_slots():
    sched = lora_scheduler(max_loras=2)
    for i, lora in enumerate([1, 2, 3, 1, 0, 3, 2]):
        sched.add(lora_req(f"r{i}", lora))
    seen = []
    while sched.has_unfinished:
        step = fake_step(sched)
        adapters = {c.request.lora_id for c in step.chunks if c.request.lora_id}
        assert len(adapters) <= 2
        running = {r.lora_id for r in sched.running if r.lora_id}
        assert len(running) <= 2
        seen.append([c.request.request_id for c in step.chunks])
    first = seen[0]
    # adapter 3's first request waits; the base request and adapter 1/2's go past it
    assert set(first) == {"r0", "r1", "r3", "r4", "r6"}


def test_without_lora_limit_queue_order_is_kept():
    sched = lora_scheduler(max_loras=None)
    for i, lora in enumerate([1, 2, 3]):
        sched.add(lora_req(f"r{i}", lora))
    step = fake_step(sched)
    assert [c.request.request_id for c in step.chunks] == ["r0", "r1", "r2"]


def test_adapter_aware_eviction_takes_plain_then_dead_then_least_used_blocks():
    pool = BlockPool(6)
    values = {("lora", "hot"): 1.0, ("lora", "cold"): 1.0, ("lora", "gone"): -1.0}
    pool.evict_value = values.__getitem__
    blocks = pool.allocate(6)
    owners = [("lora", "hot"), ("lora", "hot"), ("lora", "cold"), ("lora", "cold"),
              ("lora", "gone"), None]
    for i, (b, owner) in enumerate(zip(blocks, owners)):
        if owner is not None:
            pool.register(b, bytes([i]), owner, depth=i % 2)
    for _ in range(2):  # the hot prefix is hit twice more (shared by later requests)
        pool.touch(blocks[:2])
        pool.release(blocks[:2])
    pool.release(blocks)  # all free now: 5 cached, 1 plain
    assert pool.cached_per_owner == {("lora", "hot"): 2, ("lora", "cold"): 2, ("lora", "gone"): 1}
    order = [pool.allocate(1)[0] for _ in range(6)]
    assert order == [blocks[5], blocks[4], blocks[2], blocks[3], blocks[0], blocks[1]]
    assert not pool.cached and not pool.cached_per_owner and pool.num_evictions == 5


def test_lru_eviction_ignores_owners():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]), ("lora", str(i)))
    pool.release([blocks[2], blocks[0], blocks[1]])
    assert pool.allocate(3) == [blocks[2], blocks[0], blocks[1]]


def test_equal_use_evicts_the_deeper_block_first_and_recency_breaks_counts():
    pool = BlockPool(3)
    pool.evict_value = lambda owner: 1.0
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]), ("lora", "x"), depth=i)
    pool._score = [0.0] * 3  # same count at the same time
    pool.release(blocks)
    assert pool.allocate(3) == [blocks[2], blocks[1], blocks[0]]


def test_a_cached_block_taken_back_leaves_the_owner_groups_consistent():
    pool = BlockPool(4)
    pool.evict_value = lambda owner: 1.0
    blocks = pool.allocate(4)
    pool.register(blocks[0], b"a", ("lora", "x"))
    pool.release(blocks)
    pool.touch([blocks[0]])  # a prefix hit revives it
    assert pool.allocate(3) == blocks[1:]  # the plain ones; the revived block is in use
    pool.release([blocks[0]])
    assert pool.allocate(1) == [blocks[0]] and pool.num_evictions == 1
