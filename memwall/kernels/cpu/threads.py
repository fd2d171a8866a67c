"""OpenMP thread pools when the engine steps in a thread of its own (the server).

libgomp keeps one pool of worker threads per thread that starts parallel regions. Loading the
model in the main thread leaves the main thread's pool alive; the engine thread then gets a
second one. With more pooled threads than cores libgomp "throttles" its spin-wait: workers
sleep on a futex between parallel regions, and every region pays a wake-up. A decode step has
~150 regions, so the server's step took 3.7x the offline one (10.8 ms against 2.9 ms for
SmolLM2 on 2 cores). ``release_caller_pool`` ends the calling thread's pool (OpenMP 5's
``omp_pause_resource_all``), so the engine thread's pool is the only one.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("memwall")

OMP_PAUSE_HARD = 2


def release_caller_pool() -> bool:
    """Frees the OpenMP worker threads this thread started (a later parallel region would make
    new ones). False where the runtime is not libgomp or cannot pause."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the copy torch loaded: same soname, same library
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    ok = pause(OMP_PAUSE_HARD) == 0
    if not ok:
        logger.debug("omp_pause_resource_all failed; OpenMP pools stay as they are")
    return ok
