"""The block map's states on a hand-made pool (no model), and the view's throttle."""

from __future__ import annotations

from memwall.core.kv.block_pool import BlockPool
from memwall.core.live_view import ViewThrottle, block_states


def test_each_block_state():
    pool = BlockPool(6)
    a = pool.allocate(3)  # blocks 0, 1, 2 in use
    pool.touch([a[0]])  # block 0 shared by a second holder
    pool.register(a[1], b"hash-1")  # block 1 holds known contents ...
    pool.release([a[1]])  # ... and is free again: cached
    pool.release([a[2]])  # block 2: plain free
    states = block_states(pool)
    assert states[a[0]] == "S" and states[a[1]] == "C" and states[a[2]] == "."
    assert states.count(".") == 4 and len(states) == 6
    pool.allocate(5)  # takes every free block; the cached one is evicted last
    assert block_states(pool) == "SUUUUU"


def test_throttle():
    now = [0.0]
    throttle = ViewThrottle(0.25, clock=lambda: now[0])
    assert throttle.due()
    now[0] = 0.1
    assert not throttle.due() and throttle.due(force=True)
    now[0] = 0.3
    assert not throttle.due()  # forced at 0.1: the next is due at 0.35
    now[0] = 0.4
    assert throttle.due()


def test_a_block_shared_by_more_than_255_sequences():
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.touch([block] * 300)  # a system prompt's block under 301 sequences
    assert block_states(pool)[block] == "S" and block_states(pool).count(".") == 2
