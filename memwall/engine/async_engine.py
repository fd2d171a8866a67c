"""AsyncLLMEngine: the synchronous LLMEngine driven by a background thread, for asyncio servers.

``LLMEngine`` is not thread-safe, so exactly one thread (the engine thread) ever touches it.
Everything else talks to that thread through a command list guarded by a condition variable:

    event loop (any number)                         engine thread
    ───────────────────────                         ─────────────
    add_request() ── _Add ───────┐               ┌──> apply commands (add / abort / remove_lora /
    abort()       ── _Abort ─────┼─> [commands] ─┤    watched: a dashboard page is open)
    remove_lora() ── _RemoveLoRA ┤               │    engine.step()
    set_watched() ── _Watch ─────┘               │    publish EngineStats
    RequestStream  <── loop.call_soon_threadsafe ─────┘ (one call per loop per step)

Commands are applied *between* steps, so an abort frees its KV blocks before the next step runs.
When there is nothing to do the thread sleeps on the condition: no busy spin. Each request has
its own ``asyncio.Queue`` on the loop that created it, so thousands of streams share one thread.

When a step raises (under ``memwall serve``: the engine core process died) the requests that
were running end with EngineDeadError. Given a ``restart`` factory, the thread then builds a new
engine (a new core process) while health reports 503, and goes on with the requests that were
still queued; without one (or if restarting fails) the engine stays dead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memwall.engine.protocol import EngineStats
from memwall.kernels.cpu.threads import release_caller_pool
from memwall.outputs import RequestOutput
from memwall.sampling_params import SamplingParams

if TYPE_CHECKING:  # only for hints: tests drive this class with a fake engine
    from memwall.core.live_trace import LiveTrace
    from memwall.engine.llm_engine import LLMEngine
    from memwall.engine.processor import PromptType
    from memwall.engine.protocol import EngineCoreInfo
    from memwall.lora.request import LoRARequest

logger = logging.getLogger("memwall")
RESTART_ATTEMPTS = 3
"""Failed restarts in a row after which the engine stays dead."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no new requests (server: HTTP 503)."""


class EngineDeadError(RuntimeError):
    """A step raised (or the core process died): the requests it was running are lost (server:
    HTTP 500). The engine restarts when it can; health is 503 until it is back (or for good)."""


@dataclass
class _Add:
    request_id: str
    prompt: "PromptType"
    params: SamplingParams
    stream: "RequestStream"
    accepted: asyncio.Future  # on stream.loop: prompt token ids, or the add_request error
    lora_request: "LoRARequest | None" = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _RemoveLoRA:
    lora_int_id: int


@dataclass
class _Watch:
    watched: bool


@dataclass
class RequestStream:
    """The outputs of one request, in order, as the engine thread produces them.

    Iterate it with ``async for``; it ends after the finished output. Leaving the loop early
    (break, cancellation, error) does not abort by itself: ``AsyncLLMEngine.generate`` does that.
    """

    request_id: str
    loop: asyncio.AbstractEventLoop
    prompt_token_ids: list[int] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncLLMEngine:
    """Thread-safe, asyncio-facing wrapper: ``async for out in engine.generate(id, prompt, params)``."""

    def __init__(self, engine: "LLMEngine", restart: "Callable[[], LLMEngine] | None" = None) -> None:
        """``restart``: builds a fresh engine after a failed step (same model, new core process)."""
        self.engine = engine
        self._restart = restart
        self._restarting: BaseException | None = None  # the failure being recovered from
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _RemoveLoRA | _Watch] = []
        self._pending_adds = 0  # submitted adds not yet visible in the published stats
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats = EngineStats()
        self._closed = False  # no new requests
        self._stopping = False  # thread exits once the engine is drained
        self._abort_all = False  # shutdown without draining
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._watched = False  # a dashboard page is open (re-told to a restarted engine)

    # ---- read-only facts (immutable after load: safe from any thread) ----------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def live(self) -> "LiveTrace | None":
        """The engine core's recent steps and block map (memwall/core/live_trace.py), as the
        engine thread last received them; None for an engine without a core (test fakes). A
        restart brings a new one (its step indexes start again from 0)."""
        return getattr(getattr(self.engine, "core", None), "live", None)

    @property
    def core_info(self) -> "EngineCoreInfo | None":
        """The engine core's start-up facts (model shapes, LoRA limits); None for an engine
        without a core (test fakes). The same after a restart: same model, same arguments."""
        return getattr(getattr(self.engine, "core", None), "info", None)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running (queued in the scheduler or not yet applied)."""
        with self._cond:
            return self._stats.num_waiting + self._pending_adds

    @property
    def processor(self):
        """Chat templates and tokenization (pure: safe from any thread)."""
        return self.engine.processor

    @property
    def is_running(self) -> bool:
        return self.unavailable_reason is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def unavailable_reason(self) -> str | None:
        """Why the engine cannot serve now (health 503), or None when it can."""
        if self._dead is not None:
            return f"the engine stopped after an error: {self._dead}"
        if self._restarting is not None:
            return f"the engine is restarting after an error: {self._restarting}"
        if self._thread is None or not self._thread.is_alive():
            return "the engine is not running"
        return None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        # the engine thread's OpenMP pool must be the only one (memwall/kernels/cpu/threads.py)
        release_caller_pool()
        self._thread = threading.Thread(target=self._run, name="memwall-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting requests, lets running ones finish (or aborts them), then ends the thread."""
        with self._cond:
            self._closed = True
            self._abort_all = not drain
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # ---- requests (call from an event loop) ------------------------------------------------
    async def add_request(self, request_id: str, prompt: "PromptType", params: SamplingParams,
                          lora_request: "LoRARequest | None" = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it.

        Raises what ``LLMEngine.add_request`` raises (InvalidRequestError, ValueError...),
        EngineClosedError while shutting down, EngineDeadError after a failed step.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        accepted = loop.create_future()
        with self._cond:
            self._check_open()
            self._commands.append(_Add(request_id, prompt, params, stream, accepted, lora_request))
            self._pending_adds += 1
            self._cond.notify()
        try:
            stream.prompt_token_ids = await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: "PromptType", params: SamplingParams,
                       lora_request: "LoRARequest | None" = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they are sampled. Leaving early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, lora_request)
        async for output in self.iterate(stream):
            yield output

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yields a stream's outputs; a consumer that stops early (disconnect) aborts it."""
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request (thread-safe, never blocks); its blocks are freed before the next step."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def remove_lora(self, lora_int_id: int) -> None:
        """The adapter takes no new requests (thread-safe, never blocks): the engine core drops
        it from the workers once the requests running with it end."""
        with self._cond:
            self._commands.append(_RemoveLoRA(lora_int_id))
            self._cond.notify()

    def set_watched(self, watched: bool) -> None:
        """A dashboard page opened, or the last one closed (thread-safe, never blocks): the
        engine core builds its block map only while one is open."""
        with self._cond:
            self._watched = watched
            self._commands.append(_Watch(watched))
            self._cond.notify()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        if self._closed:
            raise EngineClosedError("the server is shutting down and accepts no new requests")
        if self._thread is None:
            raise EngineClosedError("the engine is not started: call AsyncLLMEngine.start()")

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        self._watch(self.engine)
        while True:
            try:
                while self._run_once():
                    pass
                break
            except BaseException as e:  # noqa: BLE001 - every waiter must hear about it, never a hang
                if not self._recover(e):
                    self._die(e)
                    break
        _close(self.engine)

    def _run_once(self) -> bool:
        """One round: apply commands, step, deliver. False when it is time to exit."""
        commands = self._wait_for_work()
        if commands is None:
            return False
        if self._abort_all:
            commands += [_Abort(request_id) for request_id in self._streams]
        applied_adds = self._apply(commands)
        outputs: list[RequestOutput] = []
        if self._has_work():
            outputs = self.engine.step()
        self._dispatch(outputs)
        self._publish_stats(applied_adds)
        return True

    def _has_work(self) -> bool:
        """Unfinished requests, or a core that still owes news (the blocks an abort freed; its
        own death)."""
        core = getattr(self.engine, "core", None)
        return self.engine.has_unfinished_requests() or (
            core is not None and core.has_unfinished_requests())

    def _wait_for_work(self) -> list[_Add | _Abort | _RemoveLoRA | _Watch] | None:
        """Sleeps until there are commands or unfinished requests; None when it is time to exit."""
        with self._cond:
            while not self._commands and not self._has_work():
                if self._stopping:  # drained: every request has finished
                    return None
                self._cond.wait()
            commands, self._commands = self._commands, []
            return commands

    def _wake(self) -> None:
        """Wakes the engine thread (from any thread): e.g. the core process died while idle."""
        with self._cond:
            self._cond.notify()

    def _watch(self, engine: "LLMEngine") -> None:
        """A core in another process tells of its death at once (not at the next request)."""
        core = getattr(engine, "core", None)
        if hasattr(core, "on_death"):
            core.on_death = self._wake

    def _apply(self, commands: list[_Add | _Abort | _RemoveLoRA | _Watch]) -> int:
        adds = 0
        for command in commands:
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _RemoveLoRA):
                self.engine.remove_lora(command.lora_int_id)
                continue
            if isinstance(command, _Watch):
                if hasattr(self.engine, "set_watched"):  # test fakes have none
                    self.engine.set_watched(command.watched)
                continue
            adds += 1
            try:
                prompt_ids = self.engine.add_request(command.request_id, command.prompt,
                                                     command.params, command.lora_request)
            except Exception as e:  # noqa: BLE001 - user errors go back to the caller
                _resolve(command.accepted, error=e)
                continue
            self._streams[command.request_id] = command.stream
            _resolve(command.accepted, result=prompt_ids)
        return adds

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their streams: one thread-safe call per event loop, not per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop[stream.loop].append((stream.queue, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _publish_stats(self, applied_adds: int) -> None:
        # The core's own figures when it has them: an abort frees blocks without a step.
        core = getattr(self.engine, "core", None)
        stats = core.stats() if hasattr(core, "stats") else self.engine.stats
        with self._cond:  # together, so that num_waiting never counts a request twice or not at all
            self._stats = stats
            self._pending_adds -= applied_adds

    # ---- failures --------------------------------------------------------------------------
    def _recover(self, error: BaseException) -> bool:
        """Ends the running requests and swaps in a new engine; the queued commands wait for
        it. False when there is no restart to be had (then the caller lets the engine die)."""
        if self._restart is None or self._stopping or not isinstance(error, Exception):
            return False
        logger.error("the engine failed (%s); restarting it", error)
        with self._cond:
            self._restarting = error
        self._fail_streams(EngineDeadError(f"the engine failed while running this request "
                                           f"({error}); it is restarting: retry the request"))
        _close(self.engine)
        engine = self._new_engine()
        if engine is None:
            return False
        self._watch(engine)
        if self._watched and hasattr(engine, "set_watched"):
            engine.set_watched(True)
        with self._cond:
            self.engine = engine
            self._stats = engine.stats
            self._pending_adds = sum(isinstance(c, _Add) for c in self._commands)
            self._restarting = None
        logger.info("the engine is back")
        return True

    def _new_engine(self) -> "LLMEngine | None":
        for attempt in range(RESTART_ATTEMPTS):
            if self._stopping:
                return None
            try:
                return self._restart()
            except Exception as e:  # noqa: BLE001 - logged; the next attempt may work
                logger.error("restarting the engine failed (attempt %d of %d): %s", attempt + 1,
                             RESTART_ATTEMPTS, e)
                if attempt + 1 < RESTART_ATTEMPTS:
                    time.sleep(attempt + 1.0)  # a moment for what failed (memory, a file) to recover
        return None

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._dead = error
            self._restarting = None
            commands, self._commands = self._commands, []
        failure = EngineDeadError(f"the engine stopped after an error: {error!r}")
        for command in commands:
            if isinstance(command, _Add):
                _resolve(command.accepted, error=failure)
        self._fail_streams(failure)

    def _fail_streams(self, failure: EngineDeadError) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream in self._streams.values():
            by_loop[stream.loop].append((stream.queue, failure))
        self._streams.clear()
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)


def _close(engine: "LLMEngine") -> None:
    """Shuts an engine down (its core process too); a failure here only gets logged."""
    try:
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - nothing is left to save
        logger.warning("shutting the engine down failed: %s", e)


def _deliver(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    _call_soon(future.get_loop(), settle)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


__all__ = ["AsyncLLMEngine", "EngineClosedError", "EngineDeadError", "EngineStats", "RequestStream"]
