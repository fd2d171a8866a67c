"""Executors: how the engine core reaches its workers.

    uni   one Worker in this process (memwall/executor/uniproc.py)
    mp    a process per rank on this host, calls broadcast through shared memory (multiproc.py)
    ray   an actor per rank, placed by a placement group, on one host or many (ray_executor.py)

All implement the same ABC with plain data, so the engine core does not know which it has.
"""

from memwall.executor.base import Executor, RankFailed, make_executor

__all__ = ["Executor", "RankFailed", "make_executor"]
