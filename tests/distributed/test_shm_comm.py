"""The shared-memory collectives (memwall/distributed/shm_comm.py, shm_comm.c) between real
processes: sums equal to the rank-order sum bit for bit on every rank, across the chunk
boundaries of a small segment; thousands of back-to-back calls (the double-buffering argument);
all-gathers of uneven and 2-D pieces; the baseline and AVX2 builds; a rank that never arrives
(TimeoutError, then the group stays aborted); the parent's abort() waking waiting ranks.

Spawning a process with torch costs 1-2 s here, so three processes are spawned once (the
``ranks`` fixture) and run every multi-rank scenario in turn, processes 0 and 1 also forming a
2-rank group; each test then asserts on what they reported.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import multiprocessing
import queue
import time
import traceback

import pytest
import torch

from memwall.distributed.shm_comm import ShmGroup
from memwall.kernels.cpu import build

pytestmark = pytest.mark.skipif(not build.available(),
                                reason="no C compiler: native kernels not built")

CAP = 1024  # floats per slot: small, so that chunking is exercised
SIZES = [0, 1, 575, CAP - 1, CAP, CAP + 1, 3 * CAP + 7]
PROCS = 3
SLOW_S = 30.0  # the ordinary groups' timeout: 3 processes share 2 cores in CI
TIMEOUT_S = 0.5  # the group with a rank that never arrives
ABORT_DELAY_S = 0.3  # the parent aborts this long after the ranks said they wait


def _inputs(world: int, shape: tuple[int, ...], tag: int) -> list[torch.Tensor]:
    """Every rank's input (each rank makes all of them: the same on every rank), with
    exponents spread wide so that the order of the sum changes its bits."""
    g = torch.Generator().manual_seed(world * 1_000_003 + tag * 7919 + sum(shape))
    mant = torch.randn((world, *shape), generator=g)
    return list(mant * torch.exp2(torch.randint(-20, 20, (world, *shape), generator=g).float()))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


def _reduce_checks(group: ShmGroup, tag: int) -> list[tuple[int, bool, str]]:
    """(n, equal to ((x0 + x1) + x2) ..., digest) per size, then one call through the C
    function pointer (n = -1 in the list)."""
    out = []
    for n in SIZES:
        xs = _inputs(group.world_size, (n,), tag)
        got = group.all_reduce(xs[group.rank].clone())
        out.append((n, torch.equal(got, functools.reduce(torch.add, xs)), _digest(got)))
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    xs = _inputs(group.world_size, (CAP + 3,), tag + 1)
    mine = xs[group.rank].clone()
    rc = fn(group.c_function())(group.c_context(), mine.data_ptr(), mine.numel())
    out.append((-1, rc == 0 and torch.equal(mine, functools.reduce(torch.add, xs)),
                _digest(mine)))
    return out


def _loop_checks(group: ShmGroup) -> tuple[int, float]:
    """(wrong results, seconds) over 2,000 small and 100 three-round all-reduces in a row,
    each with its own values (integers, exact in any order): a slot overwritten too early or
    read stale shows up as a wrong sum."""
    wrong, start, w = 0, time.perf_counter(), group.world_size
    ranks_sum = 100_000 * w * (w - 1) // 2
    for i in range(2100):
        n = 1 + i % 13 if i < 2000 else 2 * CAP + 3
        base = torch.arange(n, dtype=torch.float32) + i * 13
        got = group.all_reduce(base + 100_000 * group.rank)
        wrong += not torch.equal(got, base * w + ranks_sum)
    return wrong, time.perf_counter() - start


GATHERS = [  # (rows or None for 1-D, columns per rank of processes 0, 1, 2)
    (None, [3, 0, 5]),
    (None, [3 * CAP + 1, CAP, 1]),  # past the capacity
    (4, [CAP + 5, 7, 2 * CAP]),  # 2-D, every piece but one past the capacity
    (3, [0, 0, 0]),
    (1, [2, 1, 0]),
]


def _gather_checks(group: ShmGroup, tag: int) -> list[bool]:
    out = []
    for rows, sizes in GATHERS:
        sizes = sizes[:group.world_size]
        shapes = [(s,) if rows is None else (rows, s) for s in sizes]
        g = torch.Generator().manual_seed(tag + sum(sizes))
        pieces = [torch.randn(shape, generator=g) for shape in shapes]
        got = group.all_gather(pieces[group.rank], sizes)
        out.append(torch.equal(got, torch.cat(pieces, dim=-1)))
    return out


def _failures(group: ShmGroup, call) -> list[tuple[str, float]]:
    """(exception type, seconds) of ``call(group)``, twice in a row."""
    out = []
    for _ in range(2):
        start = time.perf_counter()
        try:
            call(group)
            out.append(("none", time.perf_counter() - start))
        except Exception as e:  # noqa: BLE001  (the test asserts on the type)
            out.append((type(e).__name__, time.perf_counter() - start))
    return out


def _rank_main(proc: int, names: dict[str, str], isas: list[str], q) -> None:
    """Process ``proc``: every scenario in turn (see the module docstring)."""
    r: dict = {}
    try:
        main = ShmGroup.attach(names["w3"], proc, PROCS, timeout_s=SLOW_S)
        if proc < 2:
            with ShmGroup.attach(names["w2"], proc, 2, timeout_s=SLOW_S) as two:
                r["reduce2"], r["loop2"] = _reduce_checks(two, 2), _loop_checks(two)
                r["gather2"] = _gather_checks(two, 2)
        r["reduce3"], r["loop3"], r["gather3"] = (_reduce_checks(main, 3), _loop_checks(main),
                                                  _gather_checks(main, 3))
        for isa in isas:
            with ShmGroup.attach(names[isa], proc, PROCS, SLOW_S, lib=build.library(isa)) as g:
                r[isa] = (_reduce_checks(g, 4), _gather_checks(g, 4))
        main.barrier()  # all three start the timeout scenario together
        late = ShmGroup.attach(names["timeout"], proc, PROCS, timeout_s=TIMEOUT_S)
        if proc < 2:  # process 2 never arrives ...
            r["timeout"] = _failures(late, lambda g: g.all_reduce(torch.ones(8)))
        main.barrier()  # ... until the others gave up, and then finds the group aborted
        if proc == 2:
            r["timeout"] = _failures(late, lambda g: g.all_reduce(torch.ones(8)))
        waiting = ShmGroup.attach(names["abort"], proc, PROCS + 1, timeout_s=SLOW_S)
        q.put(("waiting", proc, None))
        try:  # rank 3 does not exist: only the parent's abort() ends this
            waiting.barrier()
        except RuntimeError:
            r["woken_at"] = time.monotonic()  # system-wide: the parent compares its own
        main.close(), late.close(), waiting.close()
    except Exception:  # noqa: BLE001  (reported to the parent, which fails the tests)
        r["error"] = traceback.format_exc()
    q.put(("result", proc, r))


@pytest.fixture(scope="module")
def ranks():
    """{process: its report} after every scenario, and when the parent aborted."""
    isas = [isa for isa in ("baseline", "avx2") if build.runs_here(isa)]
    for isa in isas:
        build.library(isa)  # built once here, not by three processes at the same time
    worlds = {"w3": PROCS, "w2": 2, "timeout": PROCS, "abort": PROCS + 1,
              **{isa: PROCS for isa in isas}}
    segments = {key: ShmGroup.create(w, capacity_floats=CAP) for key, w in worlds.items()}
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    names = {key: s.name for key, s in segments.items()}
    procs = [ctx.Process(target=_rank_main, args=(p, names, isas, q), daemon=True)
             for p in range(PROCS)]
    for p in procs:
        p.start()
    reports, waiting, aborted_at = {}, set(), None
    deadline = time.monotonic() + 120
    try:
        while len(reports) < PROCS:
            try:
                kind, proc, payload = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the rank processes hang: reports from {sorted(reports)} only")
            if kind == "waiting":
                waiting.add(proc)
                if len(waiting) == PROCS:
                    time.sleep(ABORT_DELAY_S)  # they are inside barrier() by now
                    aborted_at = time.monotonic()
                    segments["abort"].abort()
            else:
                reports[proc] = payload
                if "error" in payload:  # release the others at once
                    for s in segments.values():
                        s.abort()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for s in segments.values():
            s.close(), s.unlink()
    errors = {p: r["error"] for p, r in reports.items() if "error" in r}
    assert not errors, "a rank process failed:\n" + "\n".join(errors.values())
    return reports, aborted_at, isas


def _assert_reduce(reports: list[list], world: int) -> None:
    for checks in reports:
        wrong = [n for n, ok, _ in checks if not ok]
        assert not wrong, f"{world} ranks: sums differ from the rank-order sum at n = {wrong}"
    digests = {tuple(d for _, _, d in checks) for checks in reports}
    assert len(digests) == 1, f"{world} ranks did not get bit-identical sums"


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_is_the_rank_order_sum_on_every_rank(ranks, world):
    reports, _, _ = ranks
    _assert_reduce([reports[p][f"reduce{world}"] for p in range(world)], world)


@pytest.mark.parametrize("world", [2, 3])
def test_thousands_of_calls_in_a_row_stay_exact(ranks, world):
    reports, _, _ = ranks
    for p in range(world):
        wrong, seconds = reports[p][f"loop{world}"]
        assert wrong == 0, f"rank {p} of {world}: {wrong} of 2100 all-reduces were wrong"


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_uneven_2d_and_past_capacity(ranks, world):
    reports, _, _ = ranks
    for p in range(world):
        got = reports[p][f"gather{world}"]
        wrong = [case for case, ok in zip(GATHERS, got) if not ok]
        assert not wrong, f"rank {p} of {world}: wrong gathers (rows, sizes) {wrong}"


def test_baseline_and_avx2_builds(ranks):
    reports, _, isas = ranks
    if not isas:
        pytest.skip("this CPU runs neither the baseline nor the AVX2 build")
    for isa in isas:
        _assert_reduce([reports[p][isa][0] for p in range(PROCS)], PROCS)
        assert all(all(reports[p][isa][1]) for p in range(PROCS)), f"{isa}: a wrong gather"


def test_a_rank_that_never_arrives_times_the_others_out_then_the_group_stays_aborted(ranks):
    reports, _, _ = ranks
    first = [reports[p]["timeout"][0] for p in (0, 1)]
    # the first to give up raises TimeoutError and aborts; the other may see the abort first
    assert "TimeoutError" in [kind for kind, _ in first], first
    for kind, seconds in first:
        assert kind in ("TimeoutError", "RuntimeError") and seconds < TIMEOUT_S + 2, first
    assert max(seconds for _, seconds in first) >= TIMEOUT_S * 0.9, first
    for p in range(PROCS):  # later calls, and the late rank's first: aborted at once
        later = reports[p]["timeout"][-1]
        assert later[0] == "RuntimeError" and later[1] < 0.1, (p, later)


def test_parent_abort_wakes_waiting_ranks(ranks):
    reports, aborted_at, _ = ranks
    for p in range(PROCS):
        assert "woken_at" in reports[p], f"rank {p} was not woken with RuntimeError"
        late_s = reports[p]["woken_at"] - aborted_at
        assert 0 <= late_s < 0.25, f"rank {p} woke {late_s:.3f} s after the abort"


def test_one_rank_in_process():
    with ShmGroup.create(1, capacity_floats=CAP) as segment:
        group = ShmGroup.attach(segment.name, 0, 1, timeout_s=TIMEOUT_S)
        x = torch.randn(3 * CAP + 7)
        assert torch.equal(group.all_reduce(x.clone()), x)
        t = torch.randn(4, CAP + 5)
        assert torch.equal(group.all_gather(t, [CAP + 5]), t)
        group.barrier()
        segment.abort()
        with pytest.raises(RuntimeError, match="aborted"):
            group.all_reduce(x)
        group.close()
        with pytest.raises(ValueError, match="closed"):
            group.barrier()


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="multiple of 16"):
        ShmGroup.create(2, capacity_floats=1000)
    with pytest.raises(ValueError, match="world_size=0"):
        ShmGroup.create(0)
    with pytest.raises(FileNotFoundError, match="ShmGroup.create"):
        ShmGroup.attach("mw_no_such_segment", 0, 2)
    with ShmGroup.create(2, capacity_floats=CAP) as segment:
        with pytest.raises(ValueError, match="rank=2 is out of range"):
            ShmGroup.attach(segment.name, 2, 2)
        with pytest.raises(ValueError, match="another number of ranks"):
            ShmGroup.attach(segment.name, 0, 3)
        with ShmGroup.attach(segment.name, 0, 2) as group:
            with pytest.raises(ValueError, match="contiguous float32"):
                group.all_reduce(torch.ones(4, dtype=torch.float64))
            with pytest.raises(ValueError, match="non-contiguous"):
                group.all_reduce(torch.ones(4, 4).t())
            with pytest.raises(ValueError, match="give 2 column counts"):
                group.all_gather(torch.ones(3), [3])
            with pytest.raises(ValueError, match=r"sizes\[0\] = 4"):
                group.all_gather(torch.ones(2, 3), [4, 3])
            with pytest.raises(ValueError, match="1-D or 2-D"):
                group.all_gather(torch.ones(1, 2, 3), [3, 3])
