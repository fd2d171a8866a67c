"""Many streams at once, client disconnects, metrics, and how quickly tokens leave the server."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from memwall import SamplingParams
from memwall.entrypoints.openai.server import server_socket

CORPUS = ["The quick brown fox", "Once upon a time", "def add(a, b):", "Paged attention keeps",
          "Caf\u00e9 na\u00efve", "12345 numbers", "in a land far away", "continuous batching"]


def test_64_concurrent_streams_equal_offline_and_are_counted(server, offline, text_of):
    prompts = [f"{CORPUS[i % len(CORPUS)]} {i}" for i in range(64)]
    max_tokens = [4 + i % 9 for i in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    expected = [text_of(o.outputs[0]) for o in offline.generate(prompts, params)]
    before = server.metric("memwall:request_success_total", 'finished_reason="length"')
    tokens_before = server.metric("memwall:generation_tokens_total")

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                                    timeout=120)

        async def one(prompt, m):
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=m,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        texts = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))
        await client.close()
        return texts

    assert asyncio.run(main()) == expected
    assert server.metric("memwall:request_success_total", 'finished_reason="length"') == before + 64
    assert server.metric("memwall:generation_tokens_total") == tokens_before + sum(max_tokens)
    assert server.metric("memwall:time_to_first_token_seconds_count") >= 64
    assert server.metric("memwall:http_requests_total", 'path="/v1/completions",status="200"') >= 64
    server.wait_idle()


def read_events(response: httpx.Response, count: int) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: {"):
            events.append(json.loads(line[len("data: "):]))
            if len(events) >= count:
                break
    return events


def test_disconnect_mid_stream_frees_the_kv_cache(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    aborted_before = server.metric("memwall:request_success_total", 'finished_reason="abort"')
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert len(read_events(response, 3)) == 3
            assert server.engine.stats.num_free_blocks < server.engine.stats.num_total_blocks
    # The client is gone long before 400 tokens could be generated: the request was aborted.
    server.wait_idle(timeout=5)
    assert server.metric("memwall:kv_cache_usage_perc") == 0.0
    assert server.metric("memwall:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_disconnect_of_a_non_streaming_request_aborts_it(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 450,
            "ignore_eos": True, "n": 4}
    aborted_before = server.metric("memwall:request_success_total", 'finished_reason="abort"') or 0
    # 450 engine steps take far longer than 50 ms (each step is ~0.2 ms of Python at least)
    with server.client(timeout=0.05) as http:
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/chat/completions", json=body)
    server.wait_idle(timeout=5)
    assert server.metric("memwall:kv_cache_usage_perc") == 0.0
    assert server.metric("memwall:request_success_total", 'finished_reason="abort"') > aborted_before


def test_first_token_is_streamed_before_the_rest_is_generated(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with server.client() as http:
        start = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body) as response:
            stamps = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter() - start)
    # One event per step; a core process that ran ahead of this side has its steps merged.
    assert len(stamps) >= 30
    # Each event is flushed as it is produced: the first arrives long before the last.
    assert stamps[0] < stamps[-1] / 4


def test_listening_socket_has_tcp_nodelay():
    sock = server_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_metrics_expose_engine_gauges(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("memwall:num_requests_running", "memwall:num_requests_waiting",
                 "memwall:kv_cache_usage_perc", "memwall:num_preemptions_total",
                 "memwall:prompt_tokens_total", "memwall:generation_tokens_total",
                 "memwall:time_to_first_token_seconds_bucket", "memwall:inter_token_latency_seconds_bucket",
                 "memwall:e2e_request_latency_seconds_bucket", "memwall:http_requests_total"):
        assert name in text, name
