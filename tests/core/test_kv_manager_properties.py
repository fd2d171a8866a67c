"""Property test of the KV bookkeeping: random allocate / share (prefix hit) / fork / append /
free / evict sequences keep every invariant and end with every block free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memwall.core.kv.manager import KVCacheManager
from memwall.request import Request
from memwall.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def check_invariants(kv: KVCacheManager, live: dict[str, Request]) -> None:
    pool = kv.pool
    free = set(pool._free)
    held: dict[int, int] = {}
    for rid, table in kv.block_tables.items():
        assert rid in live
        assert len(set(table)) == len(table), "a table lists a block twice"
        for b in table:
            held[b] = held.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] >= 0
        assert pool.ref_counts[b] == held.get(b, 0), f"block {b}: ref count != holders"
        assert (pool.ref_counts[b] == 0) == (b in free), f"block {b}: free-list membership wrong"
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
    # Every block registered in the cache is full of computed tokens of some request, or free.


operation = st.one_of(
    st.tuples(st.just("new"), st.integers(0, 3), st.integers(1, 20)),  # prompt family, length
    st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, min_size=1, max_size=40))
def test_random_operations_keep_invariants(ops):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
    live: dict[str, Request] = {}
    counter = 0
    for kind, a, b in ops:
        counter += 1
        if kind == "new":
            # Prompts of one family share prefixes, so lookups really hit.
            prompt = [a * 100 + i for i in range(b)]
            req = Request(f"r{counter}", prompt, SamplingParams(), max_tokens=64)
            cached = kv.find_cached_prefix(req)
            assert len(cached) * BLOCK < req.num_tokens
            req.num_computed_tokens = len(cached) * BLOCK
            if kv.allocate_slots(req, req.num_tokens, cached):
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[req.request_id] = req
        elif kind == "append" and live:
            req = list(live.values())[a % len(live)]
            new_tokens = [7] * b
            if kv.allocate_slots(req, req.num_tokens + b):
                req.output_token_ids.extend(new_tokens)
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
        elif kind == "fork" and live:
            parent = list(live.values())[a % len(live)]
            child = Request(f"r{counter}", list(parent.prompt_token_ids), SamplingParams(), max_tokens=64)
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live[child.request_id] = child
        elif kind == "free" and live:
            rid = list(live)[a % len(live)]
            kv.free(rid)
            del live[rid]
        transfers = kv.take_transfers()
        for src, dst in transfers.copies:
            assert kv.pool.ref_counts[dst] >= 1 and src != dst
        check_invariants(kv, live)
    for rid in list(live):
        kv.free(rid)
    check_invariants(kv, {})
    assert kv.num_free_blocks == NUM_BLOCKS


def test_prefix_hit_reuses_blocks_and_eviction_is_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = Request("a", list(range(10)), SamplingParams(), max_tokens=4)
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    a_blocks = kv.block_table("a")
    kv.free("a")  # blocks stay cached while free
    b = Request("b", list(range(9)) + [99], SamplingParams(), max_tokens=4)
    hit = kv.find_cached_prefix(b)
    assert hit == a_blocks[:2]  # tokens 0-7 match; 8.. differ
    assert kv.allocate_slots(b, 10, hit)
    assert kv.block_table("b")[:2] == a_blocks[:2]
    assert kv.stats.hits == 8
    # Fill the pool: the cached-but-free blocks are evicted only when nothing else is free.
    c = Request("c", [500 + i for i in range(12)], SamplingParams(), max_tokens=4)
    evictions = kv.pool.num_evictions
    assert kv.allocate_slots(c, 12)
    assert kv.pool.num_evictions == evictions  # 3 never-used blocks were free
    d = Request("d", [700], SamplingParams(), max_tokens=4)
    assert not kv.allocate_slots(d, 1)  # pool full
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 6


def test_a_whole_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(8)), SamplingParams(), max_tokens=4)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    same = Request("same", list(range(8)), SamplingParams(), max_tokens=4)
    assert len(kv.find_cached_prefix(same)) == 1  # block 2 is recomputed to get the logits


def test_prompt_logprobs_requests_bypass_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", list(range(9)), SamplingParams(), max_tokens=4)
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    wants = Request("w", list(range(9)), SamplingParams(prompt_logprobs=1), max_tokens=4)
    assert kv.find_cached_prefix(wants) == []


def test_fork_then_write_copies_the_shared_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = Request("p", list(range(6)), SamplingParams(), max_tokens=4)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Request("c", list(range(6)), SamplingParams(), max_tokens=4)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_table("c") == kv.block_table("p")
    shared_tail = kv.block_table("p")[1]
    assert kv.allocate_slots(child, 7)  # child writes position 6, inside the shared block
    assert kv.block_table("c")[1] != shared_tail and kv.block_table("c")[0] == kv.block_table("p")[0]
    assert kv.take_transfers().copies == [(shared_tail, kv.block_table("c")[1])]
    assert kv.allocate_slots(parent, 7)  # now the parent is the only holder: writes in place
    assert kv.block_table("p")[1] == shared_tail and not kv.take_transfers()
