"""The serving benchmark's pieces: metric math, the load generator against a fake SSE server
with known delays, and the ShareGPT reader on a small (deliberately cut-off) fixture."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `benchmarks`

from benchmarks import datasets, loadgen, metrics  # noqa: E402
from benchmarks.datasets import SampleRequest  # noqa: E402
from benchmarks.loadgen import RequestResult  # noqa: E402


# ---- metric math -------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    values = [10.0, 1.0, 4.0, 7.0]
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 100) == 10.0
    assert metrics.percentile(values, 50) == pytest.approx(5.5)
    assert metrics.percentile(values, 90) == pytest.approx(9.1)  # numpy.percentile's answer
    assert metrics.percentile([3.0], 99) == 3.0
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match="0..100"):
        metrics.percentile(values, 101)


def _result(ttft, e2el, tokens, itl=(), ok=True, expected=None, prompt_len=10):
    return RequestResult(prompt_len=prompt_len, expected_output_len=expected or tokens,
                         success=ok, ttft=ttft, e2el=e2el, output_tokens=tokens, itl=list(itl),
                         chunks=tokens)


def test_summary_throughput_tpot_and_goodput():
    results = [
        _result(0.1, 1.0, 10, itl=[0.1] * 9),   # TPOT 100 ms
        _result(0.5, 1.4, 10, itl=[0.1] * 9),   # TTFT 500 ms: misses a 200 ms TTFT SLO
        _result(0.1, 2.8, 10, itl=[0.3] * 9),   # TPOT 300 ms: misses a 200 ms TPOT SLO
        _result(0.0, 0.0, 0, ok=False),
    ]
    slo = metrics.SLO(ttft_ms=200, tpot_ms=200)
    m = metrics.summarize(results, duration_s=2.0, slo=slo)
    assert (m.completed, m.failed) == (3, 1)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(15.0)
    assert m.total_token_throughput == pytest.approx(30.0)
    assert m.goodput == pytest.approx(0.5) and m.slo_attainment == pytest.approx(1 / 3)
    assert m.achieved_concurrency == pytest.approx((1.0 + 1.4 + 2.8) / 2.0)
    assert m.latency["tpot"].percentiles_ms["p50"] == pytest.approx(100.0)
    assert m.latency["ttft"].mean_ms == pytest.approx(700 / 3)
    assert m.latency["itl"].count == 27
    assert m.short_outputs == 0


def test_no_slo_means_no_goodput_and_short_outputs_are_counted():
    m = metrics.summarize([_result(0.1, 0.5, 3, expected=8)], duration_s=1.0)
    assert m.goodput is None and m.slo_attainment is None
    assert m.short_outputs == 1
    assert "stopped before max_tokens" in metrics.format_table(m)


def test_comparison_table_has_ratio_column():
    fast = metrics.summarize([_result(0.1, 1.0, 10, itl=[0.1] * 9)], duration_s=1.0)
    slow = metrics.summarize([_result(0.2, 2.0, 10, itl=[0.2] * 9)], duration_s=2.0)
    table = metrics.format_comparison({"memwall": slow, "llama.cpp": fast})
    line = next(l for l in table.splitlines() if l.startswith("output throughput"))
    assert line.rstrip().endswith("0.50x")
    line = next(l for l in table.splitlines() if l.startswith("TTFT p50"))
    assert line.rstrip().endswith("2.00x")


def test_poisson_gaps_have_the_asked_rate():
    gaps = loadgen.arrival_gaps(4000, request_rate=20.0, rng=random.Random(1))
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.06)
    cv = (sum((g - 0.05) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.05
    assert cv == pytest.approx(1.0, rel=0.1)  # exponential: std == mean
    assert loadgen.arrival_gaps(3, math.inf) == [0.0, 0.0, 0.0]


# ---- the load generator against a fake server --------------------------------------------------
TTFT_S, ITL_S = 0.06, 0.02


class FakeServer:
    """A minimal HTTP/1.1 SSE server: /v1/completions streams max_tokens chunks, the first after
    TTFT_S and each next one ITL_S later, then llama.cpp's finish chunk with usage and [DONE].
    The prompt "fail" gets HTTP 500, "error" an SSE error event, "eos" no token at all, "cut"
    two tokens and no [DONE]."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader, writer):
        try:
            while True:  # keep-alive: one request after another on this connection
                await self.serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def serve_one(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET"):  # /v1/models: none here, so clients send no model name
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return await writer.drain()
        length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n")
                       if l.lower().startswith(b"content-length")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        self.bodies.append(body)
        if body.get("prompt") == "fail":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom")
            return await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        if body.get("prompt") == "error":
            await self.send(writer, {"error": {"message": "engine died"}})
        elif body.get("prompt") == "cut":
            await self.stream_tokens(writer, 2)
            writer.write(b"0\r\n\r\n")  # the body ends with no [DONE]
            return await writer.drain()
        else:
            await self.stream_tokens(writer, 0 if body["prompt"] == "eos" else body["max_tokens"])
        await self.send(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def stream_tokens(self, writer, n: int) -> None:
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            await self.send(writer, {"choices": [{"text": f" t{i}", "index": 0,
                                                  "finish_reason": None}]})
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
        await self.send(writer, {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                                 "usage": usage})

    @staticmethod
    async def send(writer, event) -> None:
        data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()


def _run(requests, **cfg):
    async def go():
        async with FakeServer() as server:
            config = loadgen.LoadConfig(base_url=server.url, model="fake", **cfg)
            results, duration = await loadgen.run_load(config, requests)
            return results, duration, server.bodies
    return asyncio.run(go())


def _samples(n, out_len=10, prompt="hi"):
    return [SampleRequest(prompt, 5, out_len) for _ in range(n)]


def test_timings_match_the_servers_delays():
    results, duration, bodies = _run(_samples(3), concurrency=1)
    assert all(r.success for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == 10 and r.chunks == 10 and r.server_prompt_tokens == 5
        assert TTFT_S <= r.ttft < TTFT_S + 0.05
        assert len(r.itl) == 9  # the finish-only chunk is no token
        assert ITL_S * 0.9 <= metrics.percentile(r.itl, 50) < ITL_S + 0.02
        assert r.e2el == pytest.approx(r.ttft + sum(r.itl))
        assert r.text == "".join(f" t{i}" for i in range(10))
    one = TTFT_S + 9 * ITL_S
    assert 3 * one <= duration < 3 * one + 0.3  # concurrency 1: strictly one after another
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[0]["ignore_eos"] is True
    assert bodies[0]["min_tokens"] == bodies[0]["max_tokens"] == 10
    assert bodies[0]["model"] == "fake" and bodies[0]["temperature"] == 0.0


def test_concurrency_overlaps_requests_and_sets_throughput():
    results, duration, _ = _run(_samples(8), concurrency=4)
    one = TTFT_S + 9 * ITL_S  # 0.24 s per request; 8 at 4 in flight: two waves
    assert 2 * one <= duration < 2 * one + 0.25
    m = metrics.summarize(results, duration)
    assert m.completed == 8 and m.total_output_tokens == 80
    assert 80 / (2 * one + 0.25) < m.output_throughput <= 80 / (2 * one)
    assert 3.0 < m.achieved_concurrency <= 4.05
    starts = sorted(r.start for r in results)
    assert starts[3] < 0.05 and starts[4] >= one * 0.95  # the fifth waits for a free slot


def test_request_rate_spreads_the_sends():
    results, duration, _ = _run(_samples(5, out_len=2), request_rate=50.0, seed=3)
    gaps = loadgen.arrival_gaps(5, 50.0, rng=random.Random(3))
    expected = [sum(gaps[: i + 1]) for i in range(5)]
    for r, t in zip(results, expected):
        assert t - 0.005 <= r.start < t + 0.05


def test_failures_are_recorded_not_raised():
    requests = [SampleRequest("fail", 1, 4), SampleRequest("error", 1, 4),
                SampleRequest("cut", 1, 4), *_samples(1, 4)]
    results, _, _ = _run(requests, concurrency=2, ignore_eos=False)
    assert not results[0].success and "HTTP 500" in results[0].error
    assert not results[1].success and results[1].error == "engine died"
    assert not results[2].success and "[DONE]" in results[2].error
    assert results[3].success
    m = metrics.summarize(results, 1.0)
    assert (m.completed, m.failed) == (1, 3)


def test_a_request_that_stops_at_once_is_a_success_with_no_tokens():
    results, _, _ = _run([SampleRequest("eos", 1, 4)], ignore_eos=False)
    r = results[0]
    assert r.success and r.output_tokens == 0 and r.chunks == 0
    assert TTFT_S <= r.ttft == r.e2el and r.itl == []


def test_without_ignore_eos_no_min_tokens_are_sent():
    _, _, bodies = _run(_samples(1, 3), ignore_eos=False)
    assert "ignore_eos" not in bodies[0] and "min_tokens" not in bodies[0]


# ---- datasets ----------------------------------------------------------------------------------
class WordTokenizer:
    """One token per space-separated word: enough to check length bookkeeping."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_random_prompts_have_exact_lengths():
    tok = WordTokenizer()
    samples = datasets.sample_random(tok, 6, input_len=12, output_len=7, seed=1)
    assert [len(tok.encode(s.prompt)) for s in samples] == [12] * 6
    assert {(s.prompt_len, s.expected_output_len) for s in samples} == {(12, 7)}
    assert len({s.prompt for s in samples}) == 6
    ranged = datasets.sample_random(tok, 50, 20, 10, range_ratio=0.5, seed=2)
    assert all(10 <= s.prompt_len <= 30 and 5 <= s.expected_output_len <= 15 for s in ranged)
    assert all(s.prompt_len == len(tok.encode(s.prompt)) for s in ranged)


def _conversation(i, human, reply):
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": human},
                                             {"from": "gpt", "value": reply}]}


def test_sharegpt_reader_repairs_a_cut_off_file(tmp_path):
    records = [_conversation(0, "one two three four five", "a b c d e f"),
               _conversation(1, "short", "too short reply x"),          # prompt < 4 tokens
               {"id": "c2", "conversations": [{"from": "gpt", "value": "no human turn"}]},
               _conversation(3, "w " * 30, "r " * 10),                  # prompt > 20 tokens
               _conversation(4, "six seven eight nine", "g h i j k")]
    text = json.dumps(records, indent=2)
    cut = json.dumps([*records, _conversation(5, "lost", "lost")], indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(cut[: len(text) + 60])  # the last record is cut mid-string
    assert [r["id"] for r in datasets.read_records(path)] == ["c0", "c1", "c2", "c3", "c4"]
    tok = WordTokenizer()
    samples = datasets.sample_sharegpt(tok, 2, seed=0, path=path, max_prompt_len=20)
    got = sorted((s.prompt, s.prompt_len, s.expected_output_len) for s in samples)
    assert got == [("one two three four five", 5, 6), ("six seven eight nine", 4, 5)]
    fixed = datasets.sample_sharegpt(tok, 1, path=path, fixed_output_len=9, max_prompt_len=20)
    assert fixed[0].expected_output_len == 9
    with pytest.raises(ValueError, match="only 2 of 5"):
        datasets.sample_sharegpt(tok, 3, path=path, max_prompt_len=20)


def test_sharegpt_reader_skips_a_broken_record_in_the_middle(tmp_path):
    good = json.dumps(_conversation(0, "a b c d", "e f g h"), indent=2)
    broken = '{\n    "id": "bad", "conversations": [ {"from": "human", "value": "x" ]\n  }'
    later = json.dumps(_conversation(2, "i j k l", "m n o p"), indent=2)
    path = tmp_path / "broken.json"
    path.write_text(f"[\n  {good},\n  {broken},\n  {later}\n]\n")
    assert [r["id"] for r in datasets.read_records(path)] == ["c0", "c2"]


def test_random_prompts_are_exact_with_the_real_gguf_tokenizer(gguf_path):
    tok = datasets.GGUFTokenizer(gguf_path)
    for length in (1, 7, 64, 200):
        samples = datasets.sample_random(tok, 3, input_len=length, output_len=4, seed=length)
        assert [len(tok.encode(s.prompt)) for s in samples] == [length] * 3


def test_cpu_meter_attributes_this_process_to_the_client():
    from benchmarks.servers import CpuMeter

    with CpuMeter() as meter:
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
    report = meter.report
    assert "server_cpu_s" not in report and report["wall_s"] >= 0.2
    assert report["client_cpu_s"] >= 0.15
    assert report["server_and_other_cpu_s"] >= 0.0
