"""Shared-memory collectives for the tensor-parallel ranks of one host: the Python side of
memwall/kernels/cpu/shm_comm.c (which draws the segment's layout and argues why one barrier
per round is safe).

    segment = ShmGroup.create(world_size)                   # the parent, once
    group = ShmGroup.attach(segment.name, rank, world_size) # each rank, in its own process
    group.all_reduce(t)           # t summed over the ranks in place, in rank order
    group.all_gather(t, sizes)    # [rows, sizes[rank]] -> [rows, sum(sizes)]
    group.close()                 # each rank;  segment.close(); segment.unlink(): the parent

A call costs a copy into the segment, one barrier and a sum: microseconds, against 1-2 ms for
gloo. The fused C decode step calls the same all-reduce without Python: ``c_function()`` and
``c_context()`` are the ``mw_allreduce_fn`` and its context.

Every rank makes the same calls in the same order with the same sizes (as with any
collective). A rank that stops arriving makes the others give up after ``timeout_s`` with
TimeoutError; from then on the group is aborted and every call raises RuntimeError (as after
``abort()``, from any rank or the parent): its rounds are out of step for good, so make a new
segment.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from multiprocessing.shared_memory import SharedMemory

import torch

from memwall.kernels.cpu import build

_ALIGN = 16  # floats: a slot of a multiple of 16 floats starts on a cache line
_ATTACH_ERRORS = {1: "was not made by ShmGroup.create (no memwall header)",
                  2: "was made for another number of ranks"}


class _Comm(ctypes.Structure):
    """mw_shm_comm (kernels.h)."""

    _fields_ = [("base", ctypes.c_void_p), ("rank", ctypes.c_int64), ("world", ctypes.c_int64),
                ("capacity", ctypes.c_int64), ("seq", ctypes.c_int64),
                ("timeout_s", ctypes.c_double)]


@contextlib.contextmanager
def _address(buffer):
    """The address of a writable buffer, for as long as the block runs (the ctypes view
    pins the buffer: it must be gone before the buffer can be closed)."""
    view = ctypes.c_char.from_buffer(buffer)
    try:
        yield ctypes.addressof(view)
    finally:
        del view


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: give the number of ranks, an int >= 1")


class ShmSegment:
    """The parent's handle of a segment (made by ``ShmGroup.create``): pass ``name`` to the
    ranks' ``ShmGroup.attach``; ``abort()`` wakes ranks waiting in a collective (a rank died);
    ``close()`` then ``unlink()`` once the ranks are done (unlink is also done by Python's
    resource tracker if the parent dies first)."""

    def __init__(self, shm: SharedMemory, world_size: int, capacity: int, lib) -> None:
        self._shm, self._lib = shm, lib
        self.world_size, self.capacity = world_size, capacity

    @property
    def name(self) -> str:
        return self._shm.name

    def abort(self) -> None:
        with _address(self._shm.buf) as base:
            self._lib.mw_shm_abort(base)

    def close(self) -> None:
        self._shm.close()

    def unlink(self) -> None:
        self._shm.unlink()

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.unlink()


class ShmGroup:
    """Ranks of one host sharing a memory segment for collectives (see shm_comm.c).

    Made by ``attach`` in each rank's process. One thread of a rank uses it at a time.
    ``lib``: the kernels to call (tests pass ``build.library(isa)``); default this CPU's.
    """

    def __init__(self, mapping: mmap.mmap, rank: int, world_size: int, timeout_s: float | None,
                 lib) -> None:
        self._lib, self._mapping = lib, mapping
        self._view = ctypes.c_char.from_buffer(mapping)  # pins the mapping while C uses it
        self._comm = _Comm()
        rc = lib.mw_shm_attach(ctypes.byref(self._comm), ctypes.addressof(self._view), rank,
                               world_size, timeout_s or 0.0)
        if rc != 0:
            self.close()
            raise ValueError(f"the shared-memory segment {_ATTACH_ERRORS[rc]} (world_size="
                             f"{world_size}): attach with the name and world_size given to "
                             f"ShmGroup.create")
        needed = lib.mw_shm_bytes(world_size, self._comm.capacity)
        if len(mapping) < needed:
            self.close()
            raise ValueError(f"the shared-memory segment has {len(mapping)} bytes, its header "
                             f"needs {needed}: it is not one ShmGroup.create made")
        self._ctx = ctypes.addressof(self._comm)
        self.rank, self.world_size = rank, world_size

    @classmethod
    def create(cls, world_size: int, capacity_floats: int = 1 << 18, lib=None) -> ShmSegment:
        """A new segment for ``world_size`` ranks whose collectives move at most
        ``capacity_floats`` floats per rank per round (longer tensors take several rounds),
        using 2 * world_size * capacity_floats * 4 bytes of shared memory."""
        _check_world(world_size)
        if not isinstance(capacity_floats, int) or capacity_floats < _ALIGN \
                or capacity_floats % _ALIGN:
            raise ValueError(f"capacity_floats={capacity_floats!r}: give a positive multiple "
                             f"of {_ALIGN} (the default, 1 << 18, suits hidden sizes up to "
                             f"~64 tokens x 4096)")
        lib = lib if lib is not None else build.require()
        shm = SharedMemory(create=True, size=lib.mw_shm_bytes(world_size, capacity_floats))
        with _address(shm.buf) as base:
            lib.mw_shm_init(base, world_size, capacity_floats)
        return ShmSegment(shm, world_size, capacity_floats, lib)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, timeout_s: float | None = 60.0,
               lib=None) -> "ShmGroup":
        """Rank ``rank`` of the segment ``name`` (``ShmSegment.name``), made for ``world_size``
        ranks. ``timeout_s``: the longest a collective waits for another rank before it
        raises TimeoutError and aborts the group; None waits for ever.

        The segment is mapped from /dev/shm directly rather than through SharedMemory, whose
        resource tracker (Python < 3.13) would unlink it when this process exits: the parent
        owns it.
        """
        _check_world(world_size)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} is out of range: give 0..{world_size - 1} for "
                             f"world_size={world_size}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: give seconds > 0, or None to wait "
                             f"for ever")
        if not name or "/" in name:
            raise ValueError(f"name={name!r}: give ShmSegment.name (no slashes)")
        lib = lib if lib is not None else build.require()
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory segment {name!r} in /dev/shm: the parent "
                                    f"makes it with ShmGroup.create (and must not have unlinked "
                                    f"it yet)") from None
        try:
            if os.fstat(fd).st_size < lib.mw_shm_bytes(world_size, 0):
                raise ValueError(f"the shared-memory segment {name!r} is too small for a "
                                 f"memwall group of {world_size} ranks: is it ShmSegment.name?")
            mapping = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        return cls(mapping, rank, world_size, timeout_s, lib)

    @property
    def capacity(self) -> int:
        """Floats per rank per round (the segment's ``capacity_floats``)."""
        return self._live().capacity

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (float32, contiguous, CPU) summed over the ranks in place and returned: rank 0's
        + rank 1's + ... in that order, so every rank gets identical bits."""
        _check_float32(t, "all_reduce")
        rc = self._lib.mw_shm_allreduce(self._live_ctx(), t.data_ptr(), t.numel())
        build.raise_for(rc, self._where("all_reduce"))
        return t

    def all_gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's ``t`` side by side, in rank order: t [rows, sizes[rank]] ->
        [rows, sum(sizes)] with rank r's columns at sum(sizes[:r]) (a vocab-parallel head's
        logits: every rank passes the same rows and sizes); 1-D t [sizes[rank]] -> the plain
        concatenation [sum(sizes)]. float32, contiguous, CPU."""
        _check_float32(t, "all_gather")
        sizes = [int(s) for s in sizes]
        if t.dim() not in (1, 2):
            raise ValueError(f"all_gather takes a 1-D or 2-D tensor, not shape {tuple(t.shape)}: "
                             f"reshape it to [rows, columns] first")
        if len(sizes) != self.world_size or min(sizes) < 0:
            raise ValueError(f"sizes={sizes}: give {self.world_size} column counts >= 0, one per "
                             f"rank")
        if t.shape[-1] != sizes[self.rank]:
            raise ValueError(f"this rank's tensor has {t.shape[-1]} columns but sizes[{self.rank}]"
                             f" = {sizes[self.rank]}: every rank passes the same sizes")
        rows = t.shape[0] if t.dim() == 2 else 1
        out = t.new_empty((*t.shape[:-1], sum(sizes)))  # [rows, sum(sizes)] or [sum(sizes)]
        cols = (ctypes.c_int64 * len(sizes))(*sizes)
        rc = self._lib.mw_shm_allgather(self._live_ctx(), t.data_ptr(), rows, cols,
                                        out.data_ptr())
        build.raise_for(rc, self._where("all_gather"))
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        build.raise_for(self._lib.mw_shm_barrier(self._live_ctx()), self._where("barrier"))

    def abort(self) -> None:
        """Ends every rank's waiting and later collectives with RuntimeError (the group is
        unusable from then on). Idempotent."""
        self._lib.mw_shm_abort(self._live().base)

    def c_function(self) -> int:
        """The address of ``int mw_shm_allreduce(void* ctx, float* buf, int64_t n)``
        (mw_allreduce_fn, kernels.h), for C callers."""
        return ctypes.cast(self._lib.mw_shm_allreduce, ctypes.c_void_p).value

    def c_context(self) -> int:
        """The address of this rank's mw_shm_comm, the ``ctx`` of ``c_function()``; valid
        until ``close()`` (keep this object alive while C may call it)."""
        self._live()
        return self._ctx

    def close(self) -> None:
        """Unmaps the segment (the parent unlinks it). Idempotent."""
        self._comm = self._ctx = None
        if self._mapping is not None:
            del self._view  # the mapping cannot close while a ctypes view pins it
            self._mapping.close()
            self._mapping = None

    def __enter__(self) -> "ShmGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self) -> _Comm:
        if self._comm is None:
            raise ValueError("this ShmGroup is closed: attach again to use the segment")
        return self._comm

    def _live_ctx(self) -> int:
        if self._ctx is None:
            self._live()  # raises
        return self._ctx

    def _where(self, op: str) -> str:
        return f"ShmGroup.{op} (rank {self.rank} of {self.world_size})"


def _check_float32(t: torch.Tensor, op: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"ShmGroup.{op} takes a contiguous float32 CPU tensor, not {t.dtype} on "
                         f"{t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}: pass "
                         f"t.float().contiguous() (and copy the result back if needed)")


__all__ = ["ShmGroup", "ShmSegment"]
