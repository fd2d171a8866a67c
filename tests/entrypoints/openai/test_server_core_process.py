"""``memwall serve`` runs the engine core in a process of its own; killing that process costs only
the requests it had: each ends with an error (SSE error event or a 500), /health is 503 until a
new core has loaded, and then the server serves again with no KV blocks held."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "My favourite colour",
           "In 1969, astronauts", "The quick brown fox", "Water boils at", "A haiku about rain:"]
KILL_TIMEOUT_S = 15  # every stream must have ended by then: none hangs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "memwall.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "512",
           "--max-num-seqs", "8", "--threads", "1", "--no-show-progress"]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def server_log(tmp_path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")[-4000:]


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def wait_for_health(url: str, proc: subprocess.Popen, status: int, timeout: float) -> float:
    """Seconds until /health answers ``status``."""
    start = time.monotonic()
    while health(url) != status:
        assert proc.poll() is None, "the server exited"
        assert time.monotonic() - start < timeout, f"/health never became {status}"
        time.sleep(0.05)
    return time.monotonic() - start


def core_pid(server_pid: int) -> int:
    """The server's engine core process (a spawned child; not multiprocessing's resource tracker)."""
    children = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            children.append(int(entry))
    assert len(children) == 1, children
    return children[0]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def stream_until_error(url: str, prompt: str, started: threading.Event) -> dict:
    """Streams a long completion; returns the error event it ends with (or what it got instead)."""
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=KILL_TIMEOUT_S) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(r.read())}
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                started.set()
            elif line == "data: [DONE]":
                break
    return {"status": 200, "events": events}


def is_engine_error(error: dict) -> bool:
    return error["type"] == "server_error" and error["code"] == "engine_dead" and bool(error["message"])


@pytest.mark.slow
def test_sigkill_of_the_core_fails_its_requests_then_the_server_recovers(tmp_path, gguf_path):
    proc, url = start_server(tmp_path)
    try:
        wait_for_health(url, proc, 200, timeout=90)
        first_core = core_pid(proc.pid)
        with ThreadPoolExecutor(9) as pool:
            started = [threading.Event() for _ in PROMPTS]
            streams = [pool.submit(stream_until_error, url, p, e) for p, e in zip(PROMPTS, started)]
            assert all(e.wait(30) for e in started), "the 8 streams did not all start"
            # A ninth request waits in the core's queue (8 sequences at most): lost with it.
            queued = pool.submit(httpx.post, f"{url}/v1/completions", timeout=KILL_TIMEOUT_S,
                                 json={"prompt": "hello", "max_tokens": 5})
            deadline = time.monotonic() + 10
            while metric(url, "memwall:num_requests_waiting") < 1:
                assert time.monotonic() < deadline, "the ninth request never queued"
                time.sleep(0.02)
            time.sleep(0.3)  # some steps later: in the core's own queue, not only on its way
            assert metric(url, "memwall:num_requests_waiting") == 1
            os.kill(first_core, signal.SIGKILL)
            killed_at = time.monotonic()
            assert wait_for_health(url, proc, 503, timeout=5) < 5
            results = [s.result(timeout=KILL_TIMEOUT_S) for s in streams]
            refused = queued.result(timeout=KILL_TIMEOUT_S)
            assert time.monotonic() - killed_at < KILL_TIMEOUT_S
        for result in results:  # headers were out: the error comes in-band, then [DONE]
            assert result["status"] == 200 and result["events"][0]["choices"], result
            assert is_engine_error(result["events"][-1]["error"]), result["events"][-1]
            assert not any(c.get("finish_reason") for e in result["events"] for c in e.get("choices", []))
        assert refused.status_code == 500 and is_engine_error(refused.json()["error"]), refused.text

        wait_for_health(url, proc, 200, timeout=60)
        assert core_pid(proc.pid) != first_core
        with ThreadPoolExecutor(8) as pool:
            body = {"max_tokens": 8, "ignore_eos": True}
            after = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", timeout=30,
                                                       json={**body, "prompt": p}), PROMPTS))
        for response in after:
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"]
        free, total = (metric(url, f"memwall:kv_cache_{k}_blocks") for k in ("free", "total"))
        assert free == total == 128 and metric(url, "memwall:kv_cache_usage_perc") == 0.0

        # An idle core that dies is noticed too (not only at the next request).
        second_core = core_pid(proc.pid)
        os.kill(second_core, signal.SIGKILL)
        wait_for_health(url, proc, 503, timeout=5)
        wait_for_health(url, proc, 200, timeout=60)
        third_core = core_pid(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert not os.path.exists(f"/proc/{third_core}")  # stopped and reaped, not orphaned
    except BaseException:
        print(server_log(tmp_path))
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
