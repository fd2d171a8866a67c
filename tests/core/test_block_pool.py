import pytest

from memwall.core.kv.block_pool import BlockPool
from memwall.core.kv.manager import KVCacheManager
from memwall.request import Request
from memwall.sampling_params import SamplingParams


def test_allocate_and_release_return_every_block():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free_blocks == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(a)
    pool.release(b)
    assert pool.num_free_blocks == 8


def test_shared_block_stays_in_use_until_last_release():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])
    pool.release([block])
    assert pool.num_free_blocks == 1 and pool.ref_counts[block] == 1
    assert block not in pool.allocate(1)
    pool.release([block])
    assert pool.ref_counts[block] == 0


def test_double_release_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(blocks)


def make_request(rid, num_tokens=1):
    return Request(rid, list(range(num_tokens)), SamplingParams(), max_tokens=16)


def test_manager_grows_block_tables_by_token_count():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 5)  # 2 blocks
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots(a, 8)  # still 2
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots(b, 8)
    assert not kv.allocate_slots(a, 9)  # needs a third block: none left, nothing allocated
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == 0
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4
