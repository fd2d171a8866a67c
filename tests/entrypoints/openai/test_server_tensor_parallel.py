"""``memwall serve --tensor-parallel-size 2``: a rank that dies or hangs costs only the requests
in flight (a streamed one ends with an in-band engine error; one not yet streaming gets a 500),
/health is 503 until a new group has loaded, a request sent meanwhile waits for it, and then
the server serves again; no rank process outlives its group or the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.test_server_core_process import (KILL_TIMEOUT_S, core_pid, free_port,
                                                                is_engine_error, metric,
                                                                server_log, stream_until_error,
                                                                wait_for_health)

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "Water boils at"]
COMM_TIMEOUT_S = 3  # a hung rank is declared dead after this


def start_server(tmp_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "memwall.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "512",
           "--max-num-seqs", "8", "--tensor-parallel-size", "2",
           "--comm-timeout-s", str(COMM_TIMEOUT_S), "--no-show-progress"]
    log = open(tmp_path / "server.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def rank_pids(core: int) -> list[int]:
    """The core's rank processes (spawned children)."""
    ranks = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == core and b"spawn_main" in cmdline:
            ranks.append(int(entry))
    return sorted(ranks)


def fail_a_rank_mid_stream(url: str, proc, core: int, how: signal.Signals) -> None:
    """Runs 4 streamed requests and a non-streamed one, sends ``how`` to rank 1: every stream
    ends with the engine error, the other request gets a 500, /health goes 503 and back to
    200, and a request sent meanwhile is served by the new group."""
    with ThreadPoolExecutor(6) as pool:
        started = [threading.Event() for _ in PROMPTS]
        streams = [pool.submit(stream_until_error, url, p, e) for p, e in zip(PROMPTS, started)]
        whole = pool.submit(httpx.post, f"{url}/v1/completions", timeout=KILL_TIMEOUT_S + 60,
                            json={"prompt": "Tell me", "max_tokens": 400, "ignore_eos": True})
        assert all(e.wait(60) for e in started), "the streams did not start"
        deadline = time.monotonic() + 10
        while metric(url, "memwall:num_requests_running") < len(PROMPTS) + 1:
            assert time.monotonic() < deadline, "the non-streamed request never ran"
            time.sleep(0.02)
        ranks = rank_pids(core)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], how)
        wait_for_health(url, proc, 503, timeout=KILL_TIMEOUT_S)  # noticed (a hang: on timeout)
        late = pool.submit(httpx.post, f"{url}/v1/completions", timeout=KILL_TIMEOUT_S + 10,
                           json={"prompt": "hello", "max_tokens": 5})
        results = [s.result(timeout=KILL_TIMEOUT_S + 10) for s in streams]
        lost = whole.result(timeout=KILL_TIMEOUT_S + 10)
        refused = late.result(timeout=KILL_TIMEOUT_S + 10)
    assert lost.status_code == 500 and is_engine_error(lost.json()["error"]), lost.text
    for result in results:
        assert result["status"] == 200, result
        assert is_engine_error(result["events"][-1]["error"]), result["events"][-1]
    # sent while the group restarts: queued for the new group (or 503 if it took too long)
    assert refused.status_code in (200, 503), refused.text
    if refused.status_code == 200:
        assert refused.json()["choices"][0]["finish_reason"] == "length"
    wait_for_health(url, proc, 200, timeout=90)


@pytest.mark.slow
def test_a_killed_or_hung_rank_fails_its_requests_then_the_group_restarts(tmp_path, gguf_path):
    proc, url = start_server(tmp_path)
    try:
        wait_for_health(url, proc, 200, timeout=120)
        first_core = core_pid(proc.pid)
        first_ranks = rank_pids(first_core)
        fail_a_rank_mid_stream(url, proc, first_core, signal.SIGKILL)
        for pid in first_ranks:  # the old group is gone, not orphaned
            assert not os.path.exists(f"/proc/{pid}"), pid

        second_core = core_pid(proc.pid)
        stopped = rank_pids(second_core)
        fail_a_rank_mid_stream(url, proc, second_core, signal.SIGSTOP)  # hangs: timeout
        for pid in stopped:
            assert not os.path.exists(f"/proc/{pid}"), pid

        body = {"max_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            after = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", timeout=60,
                                                       json={**body, "prompt": p}), PROMPTS))
        for response in after:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
        assert metric(url, "memwall:kv_cache_free_blocks") == 128

        last_ranks = rank_pids(core_pid(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        time.sleep(0.5)
        for pid in last_ranks:
            assert not os.path.exists(f"/proc/{pid}"), pid
    except BaseException:
        print(server_log(tmp_path))
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
