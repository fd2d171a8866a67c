"""The server with --data-parallel-size 2 (memwall/engine/dp_client.py): concurrent greedy
completions equal the offline engine's, /metrics adds up both replicas, and a killed replica
takes the engine down and the restart brings both back."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.conftest import ENGINE_ARGS

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "My favourite colour",
           "The quick brown fox", "Water boils at"]


@pytest.fixture(scope="module")
def dp_server(model_dir, start_server):
    live = start_server(model_dir, core_process=True, data_parallel_size=2)
    yield live
    live.stop()


def complete(live, prompt: str) -> str:
    with live.client() as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_completions_equal_offline_and_metrics_add_up(dp_server, offline, text_of):
    from memwall import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [text_of(o.outputs[0]) for o in offline.generate(PROMPTS, params)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: complete(dp_server, p), PROMPTS)) == expected
    dp_server.wait_idle()
    router = dp_server.engine.engine.core.router.stats()
    assert sum(router.routed) == len(PROMPTS) and min(router.routed) >= 1
    total = dp_server.metric("memwall:kv_cache_total_blocks")
    assert total == 2 * ENGINE_ARGS["num_kv_blocks"]
    assert dp_server.metric("memwall:kv_cache_free_blocks") == total
    assert dp_server.metric("memwall:num_requests_running") == 0


def test_a_killed_replica_restarts_the_engine(dp_server):
    core = dp_server.engine.engine.core
    os.kill(core.processes[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while dp_server.engine.engine.core is core or not dp_server.engine.is_running:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.05)
    assert not any(p.is_alive() for p in core.processes)  # the live replica went too
    assert httpx.get(f"{dp_server.url}/health", timeout=5).status_code == 200
    assert complete(dp_server, "Once upon a time")
    assert len(dp_server.engine.engine.core.processes) == 2
