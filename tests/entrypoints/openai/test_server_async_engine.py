"""AsyncLLMEngine against a fake synchronous engine: threading, queues, aborts, errors, shutdown.

The fake produces one token per step per request, so these tests need no model and run in
milliseconds; the real engine behind the server is covered by the other files here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from memwall.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineDeadError
from memwall.engine.protocol import EngineStats
from memwall.engine.processor import InvalidRequestError
from memwall.outputs import CompletionOutput, RequestOutput
from memwall.sampling_params import SamplingParams


class FakeEngine:
    """One token ("x") per step per request; asserts it is only ever called from one thread."""

    def __init__(self, num_blocks: int = 100, fail_on_step: int | None = None) -> None:
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.num_total_blocks = num_blocks
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.threads: set[int] = set()
        self.closed = False
        self.tokenizer = None
        self.model_name = "fake"
        self.max_model_len = 64
        self.processor = SimpleNamespace(vocab_size=10)

    @property
    def stats(self) -> EngineStats:
        # one block per live request
        return EngineStats(num_running=len(self.requests), num_total_blocks=self.num_total_blocks,
                           num_free_blocks=self.num_total_blocks - len(self.requests))

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.threads.add(threading.get_ident())
        if prompt == "too long":
            raise InvalidRequestError("prompt too long", "prompt", "context_length_exceeded")
        self.requests[request_id] = {"left": params.max_tokens, "ids": [], "finish": None}
        return [1, 2, 3]

    def abort_request(self, request_id):
        self.threads.add(threading.get_ident())
        if request_id in self.requests:
            self.requests[request_id]["finish"] = "abort"
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def shutdown(self):
        self.threads.add(threading.get_ident())
        self.closed = True

    def step(self):
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom")
        outputs = []
        for rid, r in list(self.requests.items()):
            delta = []
            if r["finish"] is None:
                r["ids"].append(7)
                delta = [7]
                r["left"] -= 1
                if r["left"] == 0:
                    r["finish"] = "length"
            done = r["finish"] is not None
            sample = CompletionOutput(0, "x" * len(r["ids"]), list(r["ids"]), finish_reason=r["finish"],
                                      delta_text="x" * len(delta), delta_token_ids=delta)
            outputs.append(RequestOutput(rid, None, [1, 2, 3], [sample], finished=done))
            if done:
                del self.requests[rid]
        return outputs


def run(coro):
    return asyncio.run(coro)


def test_outputs_stream_in_order_and_stats_settle():
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()

    async def main():
        texts = [o.outputs[0].text async for o in engine.generate("a", "hi", SamplingParams(max_tokens=5))]
        await engine.shutdown()
        return texts

    assert run(main()) == ["x", "xx", "xxx", "xxxx", "xxxxx"]
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks == 100
    assert engine.num_waiting == 0


def test_add_errors_reach_the_caller():
    engine = AsyncLLMEngine(FakeEngine())
    engine.start()

    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await engine.add_request("a", "too long", SamplingParams())
        assert info.value.code == "context_length_exceeded"
        await engine.shutdown()

    run(main())


def test_cancelling_the_consumer_aborts_the_request():
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()

    async def consume():
        async for _ in engine.generate("a", "hi", SamplingParams(max_tokens=10**6)):
            pass

    async def main():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()

    run(main())
    assert fake.aborted == ["a"] and not fake.requests


def test_idle_engine_does_not_spin():
    fake = FakeEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()
    time.sleep(0.2)
    assert fake.steps == 0  # asleep on the condition: no steps, no polling
    run(engine.shutdown())
    assert not engine.is_running


def test_thousands_of_streams_share_one_thread():
    fake = FakeEngine(num_blocks=5000)
    engine = AsyncLLMEngine(fake)
    engine.start()

    async def one(i):
        return [o async for o in engine.generate(str(i), "hi", SamplingParams(max_tokens=3))][-1]

    async def main():
        outs = await asyncio.gather(*(one(i) for i in range(2000)))
        await engine.shutdown()
        return outs

    outs = run(main())
    assert all(o.finished and o.outputs[0].token_ids == [7, 7, 7] for o in outs)
    assert fake.steps < 100  # batched: far fewer steps than requests


def test_shutdown_drains_running_requests_and_refuses_new_ones():
    engine = AsyncLLMEngine(FakeEngine())
    engine.start()

    async def main():
        stream = await engine.add_request("a", "hi", SamplingParams(max_tokens=20))
        await engine.shutdown(drain=True)
        with pytest.raises(EngineClosedError):
            await engine.add_request("b", "hi", SamplingParams())
        return [o async for o in stream]

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 20


def test_a_failing_step_fails_every_stream_and_later_adds():
    engine = AsyncLLMEngine(FakeEngine(fail_on_step=3))
    engine.start()

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("a", "hi", SamplingParams(max_tokens=10)):
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "hi", SamplingParams())

    run(main())
    assert not engine.is_running


def test_a_failed_step_ends_running_requests_and_a_restart_serves_the_next():
    broken, fresh = FakeEngine(fail_on_step=3), FakeEngine()
    engine = AsyncLLMEngine(broken, restart=lambda: (time.sleep(0.2), fresh)[1])
    engine.start()

    async def main():
        with pytest.raises(EngineDeadError, match="restarting"):
            async for _ in engine.generate("a", "hi", SamplingParams(max_tokens=10)):
                pass
        assert not engine.is_running and "restarting" in engine.unavailable_reason
        # Sent while the new engine starts: it waits for it, and is not lost.
        outs = [o async for o in engine.generate("b", "hi", SamplingParams(max_tokens=3))]
        assert engine.is_running and engine.unavailable_reason is None
        await engine.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [7, 7, 7]
    assert broken.closed and fresh.closed and engine.engine is fresh
    assert engine.num_waiting == 0


def test_when_restarting_fails_the_engine_stays_dead(monkeypatch):
    import memwall.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "RESTART_ATTEMPTS", 1)

    def restart():
        raise ValueError("no memory left")

    engine = AsyncLLMEngine(FakeEngine(fail_on_step=2), restart=restart)
    engine.start()

    async def main():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("a", "hi", SamplingParams(max_tokens=10)):
                pass
        for _ in range(100):
            if engine.dead_error is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "hi", SamplingParams())

    run(main())
    assert "stopped" in engine.unavailable_reason
