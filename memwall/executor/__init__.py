"""Executors: how the engine core reaches its workers.

    uni   one Worker in this process (today's only backend; memwall/executor/uniproc.py)

The parallel executors (a worker process per rank, Ray actors) implement the same ABC, so
the engine core does not change when they arrive.
"""

from memwall.executor.base import Executor, make_executor

__all__ = ["Executor", "make_executor"]
