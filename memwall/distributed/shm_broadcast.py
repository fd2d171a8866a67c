"""ShmBroadcast: one writer, N readers on the same machine, each message pickled once.

The engine core sends every step's ``SchedulerOutput`` (and the rarer control messages: load
the model, allocate the cache, add a LoRA adapter, shut down) to its tensor-parallel workers.
Pickling per rank per step would cost N pickles and N pipe copies; here the writer pickles once
into a ring of slots in one shared-memory segment and every reader unpickles from there.

    segment  (name mw_bc_<hex>, 8 + n_slots * slot_bytes bytes)
    +--------+--------------------+--------------------+-----+--------------------+
    | header | slot 0             | slot 1             | ... | slot n_slots-1     |
    +--------+--------------------+--------------------+-----+--------------------+
      header: b"MWBC", closed (u8: the writer closed), 3 bytes padding

    slot  (slot_bytes bytes)
      0   written   u8                lap tag of the message in this slot   (writer, written last)
      1   kind      u8                0: payload is the pickle   1: payload is a segment name
      8   length    u64               payload bytes
      16  read[r]   u8 x n_readers    lap tag of the message reader r finished  (reader r only)
      H   payload   slot_bytes - H    H = 16 + n_readers, rounded up to 8

Message k (0-based) goes into slot k % n_slots on lap k // n_slots; its tag is (lap + 1) % 256.
The writer reuses a slot only once every reader's read[r] shows the previous lap's tag, so it
is never more than one lap ahead of any reader: a reader waiting on a slot sees either the old
tag or the one it wants, never an ambiguous one, and one byte per flag is enough. A reader that
falls behind holds back only the writer (when it wants that reader's unread slot), never the
other readers. Every flag byte has exactly one process that writes it.

A pickle larger than a slot's payload goes into a one-off segment (``mw_bc_<hex>_<k>``) whose
name is the slot's payload. The writer unlinks it once every reader has flagged the slot read
(checked at each ``put``) and, at the latest, in ``close()``: no segment outlives the writer.

Waiting, on both sides, spins ~50 us on the flag (a message already on its way is seen within
microseconds), then ``sleep(0)``, then sleeps doubling from 50 us up to 1 ms: a reader idle for
hours wakes ~1,000 times a second, a few percent of a core at most, but a message that finds
its reader asleep waits up to the current sleep (tests/distributed/test_shm_broadcast.py
measures both figures).
"""

from __future__ import annotations

import inspect
import os
import pickle
import secrets
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable

PREFIX = "mw_bc_"  # every segment of ours in /dev/shm starts with this
_MAGIC = b"MWBC"
_CLOSED = 4  # offset of the writer-closed flag in the segment header
_HEADER = 8  # segment header bytes
_WRITTEN, _KIND, _LENGTH, _READ = 0, 1, 8, 16  # offsets inside a slot
_INLINE, _SEGMENT = 0, 1  # kinds
_MIN_PAYLOAD = 64  # a slot must at least hold the name of a one-off segment
_SPIN_S = 50e-6  # how long a waiter polls before it first yields the CPU
_FIRST_SLEEP_S = 50e-6  # Linux rounds shorter sleeps up to ~50-60 us anyway (timer slack)
_MAX_SLEEP_S = 1e-3


@dataclass(frozen=True)
class BroadcastHandle:
    """What a reader process needs to attach: pass it to the spawned worker."""

    name: str  # the segment's name in /dev/shm
    n_readers: int
    slot_bytes: int
    n_slots: int


class ShmBroadcast:
    """One writer, n_readers readers, a ring of slots in one shared-memory segment.

    The constructor makes the writer (and creates the segment); ``attach`` makes reader
    ``reader`` in another process. Messages arrive at every reader in ``put`` order. The writer
    blocks in ``put`` while the slot it needs still holds a message some reader has not read,
    so every one of the n_readers readers must attach and keep calling ``get``.

    One thread uses each end. A writer that dies without ``close()`` leaves its readers
    waiting (its segment is unlinked by the resource tracker when its process tree exits):
    pass a ``timeout`` where the reader must notice.
    """

    def __init__(self, n_readers: int, slot_bytes: int = 1 << 20, n_slots: int = 8) -> None:
        _check_sizes(n_readers, slot_bytes, n_slots)
        name = PREFIX + secrets.token_hex(6)
        size = _HEADER + n_slots * slot_bytes
        _check_room(size, "the broadcast ring")
        self._setup(BroadcastHandle(name, n_readers, slot_bytes, n_slots), None,
                    SharedMemory(name=name, create=True, size=size))
        self._shm.buf[0:len(_MAGIC)] = _MAGIC
        # Holds the segments, not self: runs once, from close(), garbage collection or exit.
        self._writer_cleanup = weakref.finalize(self, _unlink_all, self._shm, self._segments)

    @classmethod
    def attach(cls, handle: BroadcastHandle, reader: int) -> "ShmBroadcast":
        """Reader ``reader`` (0 .. n_readers-1) of the ring the writer's ``handle()`` names.

        The segment is not handed to this process's resource tracker: the writer owns
        unlinking it (see ``_attach_untracked``).
        """
        if not 0 <= reader < handle.n_readers:
            raise ValueError(f"reader={reader} is out of range: this ring has "
                             f"{handle.n_readers} readers, numbered 0..{handle.n_readers - 1}")
        try:
            shm = _attach_untracked(handle.name)
        except FileNotFoundError:
            raise FileNotFoundError(f"no broadcast segment {handle.name!r} in /dev/shm: the writer "
                                    "has closed it, or the handle is from another run") from None
        expected = _HEADER + handle.n_slots * handle.slot_bytes
        if bytes(shm.buf[0:len(_MAGIC)]) != _MAGIC or shm.size < expected:
            shm.close()
            raise ValueError(f"segment {handle.name!r} is not a broadcast ring of {expected} "
                             "bytes: the handle does not match the segment it names")
        self = cls.__new__(cls)
        self._setup(handle, reader, shm)
        return self

    def _setup(self, handle: BroadcastHandle, reader: int | None, shm: SharedMemory) -> None:
        self._handle, self._reader, self._shm, self._buf = handle, reader, shm, shm.buf
        self._head = _slot_header_bytes(handle.n_readers)
        self._next = 0  # the index of the next message to put (writer) or get (reader)
        self._segments: dict[int, SharedMemory] = {}  # writer: slot -> its one-off segment
        self._closed = False

    def handle(self) -> BroadcastHandle:
        """Picklable: what ``attach`` needs in the reader's process."""
        return self._handle

    @property
    def max_inline_bytes(self) -> int:
        """The largest pickle that fits in a slot; larger ones go through a one-off segment."""
        return self._handle.slot_bytes - self._head

    # ---- writer ---------------------------------------------------------------------------

    def put(self, obj: Any, timeout: float | None = None) -> None:
        """Pickles ``obj`` once and publishes it to every reader.

        Blocks while the slot it needs holds a message some reader has not read yet; raises
        TimeoutError after ``timeout`` seconds (None: wait forever).
        """
        self._require(writer=True, op="put")
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # protocol 5: in-band buffers
        lap, slot = divmod(self._next, self._handle.n_slots)
        base = self._slot_base(slot)
        self._wait_for_readers(slot, lap, timeout)
        self._reap_segments()
        if len(data) <= self.max_inline_bytes:
            kind, payload = _INLINE, data
        else:
            kind, payload = _SEGMENT, self._write_segment(slot, data)
        start = base + self._head
        self._buf[start:start + len(payload)] = payload
        self._buf[base + _KIND] = kind
        struct.pack_into("<Q", self._buf, base + _LENGTH, len(payload))
        # The tag goes last: a reader that sees it must see the payload and length too. Python
        # has no fences; this relies on x86-64 (TSO) not reordering stores with other stores,
        # nor loads with other loads. A weakly ordered CPU (ARM) would need barriers here.
        self._buf[base + _WRITTEN] = (lap + 1) & 0xFF
        self._next += 1

    def _wait_for_readers(self, slot: int, lap: int, timeout: float | None) -> None:
        """Returns once every reader has read the slot's message of the previous lap."""
        n = self._handle.n_readers
        free = bytes([lap & 0xFF]) * n
        base = self._slot_base(slot)
        with self._buf[base + _READ:base + _READ + n] as read_tags:
            if _wait_until(lambda: read_tags == free, _deadline(timeout)):
                return
            behind = [r for r, tag in enumerate(read_tags) if tag != free[0]]
        raise TimeoutError(
            f"put() waited {timeout} s for slot {slot}: reader(s) {behind} have not read message "
            f"{self._next - self._handle.n_slots} yet (a reader that stopped calling get(), or "
            "never attached, holds the ring full)")

    def _write_segment(self, slot: int, data: bytes) -> bytes:
        """Copies ``data`` into a new one-off segment; returns its name for the slot."""
        name = f"{self._handle.name}_{self._next}"
        _check_room(len(data), f"message {self._next}")
        segment = SharedMemory(name=name, create=True, size=len(data))
        segment.buf[:len(data)] = data
        segment.close()  # unmapped here; the name lives until _reap_segments unlinks it
        self._segments[slot] = segment
        return name.encode()

    def _reap_segments(self) -> None:
        """Unlinks every one-off segment whose slot all readers have read."""
        for slot in list(self._segments):
            base = self._slot_base(slot)
            tag = self._buf[base + _WRITTEN]
            if all(t == tag for t in self._buf[base + _READ:base + _READ + self._handle.n_readers]):
                self._segments.pop(slot).unlink()

    # ---- reader ---------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Any:
        """The next message, in ``put`` order.

        Raises TimeoutError after ``timeout`` seconds without one (None: wait forever), and
        EOFError once the writer has closed the ring and this reader has no message left. A
        message that fails to unpickle is consumed all the same: its error propagates, and the
        next ``get`` returns the next message (a retry would fail again and wedge the ring).
        """
        self._require(writer=False, op="get")
        lap, slot = divmod(self._next, self._handle.n_slots)
        base = self._slot_base(slot)
        tag, buf = (lap + 1) & 0xFF, self._buf
        if not _wait_until(lambda: buf[base + _WRITTEN] == tag or buf[_CLOSED], _deadline(timeout)):
            raise TimeoutError(f"get() waited {timeout} s and message {self._next} was not put")
        if buf[base + _WRITTEN] != tag:
            raise EOFError(f"the writer closed the ring after {self._next} messages")
        # The tag was read first, then length and payload: the mirror of put's store order.
        try:
            return self._read_slot(base)
        finally:  # only once unpickled: the writer may reuse the slot from now on
            buf[base + _READ + self._reader] = tag
            self._next += 1

    def _read_slot(self, base: int) -> Any:
        (length,) = struct.unpack_from("<Q", self._buf, base + _LENGTH)
        start = base + self._head
        with self._buf[start:start + length] as payload:
            if self._buf[base + _KIND] == _INLINE:
                return pickle.loads(payload)  # copies out: the object shares nothing with the slot
            name = bytes(payload).decode()
        try:
            segment = _attach_untracked(name)
        except FileNotFoundError:
            raise EOFError(f"message {self._next} ({name!r}) is gone: the writer closed the ring "
                           "before this reader read it") from None
        try:
            with segment.buf[:segment.size] as view:
                return pickle.loads(view)
        finally:
            segment.close()

    # ---- both -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unmaps the ring. The writer also marks it closed and unlinks it and every one-off
        segment still alive (readers that have not read those messages get EOFError); a writer
        that is garbage-collected, or alive at interpreter exit, does so too. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reader is None:
            self._writer_cleanup()
        else:
            self._shm.close()

    def __enter__(self) -> "ShmBroadcast":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_base(self, slot: int) -> int:
        return _HEADER + slot * self._handle.slot_bytes

    def _require(self, writer: bool, op: str) -> None:
        if self._closed:
            raise ValueError(f"{op}() on a closed ShmBroadcast ({self._handle.name})")
        if writer != (self._reader is None):
            role = "the writer" if self._reader is None else f"reader {self._reader}"
            raise RuntimeError(f"{op}() is for the {'writer' if writer else 'readers'}; "
                               f"this ShmBroadcast is {role}")


def _unlink_all(shm: SharedMemory, segments: dict[int, SharedMemory]) -> None:
    """The writer's end: marks the ring closed, unlinks it and its live one-off segments."""
    shm.buf[_CLOSED] = 1
    for segment in segments.values():
        segment.unlink()
    segments.clear()
    shm.close()
    shm.unlink()


def _wait_until(ready: Callable[[], Any], deadline: float | None) -> bool:
    """Polls ``ready`` until it is true (returns True) or ``deadline`` passes (returns False).

    Spins first, so a message already on its way is seen within microseconds; then backs off
    to sleeps of up to _MAX_SLEEP_S, so a process that waits for hours costs next to nothing.
    """
    spin_end = time.perf_counter() + _SPIN_S
    while not ready():
        if time.perf_counter() >= spin_end:
            break
    else:
        return True
    pause = 0.0
    while not ready():
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            return False
        time.sleep(pause if deadline is None else min(pause, deadline - now))
        pause = min(_MAX_SLEEP_S, max(2 * pause, _FIRST_SLEEP_S))
    return True


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.perf_counter() + timeout


def _check_sizes(n_readers: int, slot_bytes: int, n_slots: int) -> None:
    if n_readers < 1 or n_slots < 1:
        raise ValueError(f"n_readers={n_readers}, n_slots={n_slots}: both must be at least 1")
    smallest = _slot_header_bytes(n_readers) + _MIN_PAYLOAD
    if slot_bytes < smallest:
        raise ValueError(f"slot_bytes={slot_bytes} is too small for {n_readers} readers: a slot "
                         f"needs at least {smallest} bytes (its header and a segment name)")


def _slot_header_bytes(n_readers: int) -> int:
    return (_READ + n_readers + 7) // 8 * 8  # the read flags, rounded up to 8 bytes


def _check_room(nbytes: int, what: str) -> None:
    """Fails with a clear error where writing would otherwise die of SIGBUS on a full tmpfs
    (Docker's default /dev/shm is 64 MB): shared-memory pages are only allocated when touched."""
    if not os.path.isdir("/dev/shm"):
        return
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise MemoryError(f"{what} needs {nbytes / 2**20:.1f} MiB of shared memory but "
                          f"/dev/shm has {free / 2**20:.1f} MiB free: enlarge it "
                          "(docker run --shm-size=...)")


_TRACK_ARG = "track" in inspect.signature(SharedMemory).parameters  # Python 3.13+
_TRACKER_LOCK = threading.Lock()


def _attach_untracked(name: str) -> SharedMemory:
    """Maps an existing segment without registering it with the resource tracker.

    Python < 3.13 registers every SharedMemory it opens, so a reader's tracker would unlink the
    writer's segment (warning of a "leaked shared_memory") when the reader exits. Unregistering
    after attaching is no cure when reader and writer share one tracker, as a spawned worker
    shares its parent's: it drops the writer's registration, and the writer's unlink then makes
    the tracker print a KeyError. So registration is skipped for the attach; a thread creating
    a SharedMemory at that very moment would go untracked too (attaches are rare: start-up and
    messages larger than a slot).
    """
    if _TRACK_ARG:
        return SharedMemory(name=name, track=False)
    with _TRACKER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda *args: None
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register
