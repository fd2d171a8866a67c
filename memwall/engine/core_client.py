"""MPCoreClient: the ``CoreClient`` (memwall/engine/llm_engine.py) of an EngineCore that runs in a
process of its own, as under ``memwall serve``. The API process tokenizes, detokenizes and
streams; the core process schedules and runs the model (memwall/engine/core_proc.py).

    API process                                          core process (core_proc.py)
    LLMEngine ── add_request / abort_requests ── pipe ──> apply the messages, step()
    LLMEngine.step() <── queue <── reader thread <── pipe ── EngineCoreOutputs, one per step

A reader thread drains the outputs pipe at once, so the core never blocks on a full pipe while
the API side is busy. It also sees the core die: a crash, SIGKILL or the OOM killer closes the
pipe (EOF), and ``step()`` raises EngineCoreDeadError at once; ``on_death`` (when set) is called
too, so that an idle server notices without waiting for a request. ``step()`` hands over what
came since the last call, merged: an API side that fell behind catches up in one go. One client
per core process: after a death the owner builds a new one (AsyncLLMEngine's restart does).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable

from memwall.config import EngineArgs
from memwall.core.live_trace import LiveTrace
from memwall.engine.core_proc import run_engine_core
from memwall.engine.protocol import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, EngineStats

logger = logging.getLogger("memwall")

POLL_S = 0.05
"""Longest ``step()`` waits for news, so the caller can send new commands meanwhile."""
SHUTDOWN_S = 10.0
"""How long a shutdown waits for the core to exit before killing it."""
_DEAD = object()  # the reader's last word: the outputs pipe closed


class EngineCoreStartError(RuntimeError):
    """The core process could not load the engine; the message is one line for users."""


class EngineCoreDeadError(RuntimeError):
    """The core process is gone; the requests it was running are lost."""


class MPCoreClient:
    def __init__(self, args: EngineArgs, cpus: tuple[int, ...] | None = None) -> None:
        """Starts the core process and waits until it has loaded the model. ``cpus``: the cores
        the process may run on (data parallel replicas split the host's); None: this one's.

        Raises EngineCoreStartError with the core's one-line error when it cannot start."""
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads/OpenMP
        child_requests, self._requests = ctx.Pipe(duplex=False)  # (read end, write end)
        self._outputs_pipe, child_outputs = ctx.Pipe(duplex=False)
        # Not a daemon: a daemonic process may not start processes (parallel executors will).
        self.process = ctx.Process(target=run_engine_core, name="memwall-core", daemon=False,
                                   args=(args, child_requests, child_outputs))
        self.process.start()
        if cpus is not None:  # before it starts a thread: every one it makes inherits the set
            os.sched_setaffinity(self.process.pid, cpus)
        child_requests.close()  # only the child holds these ends: its death closes the pipes
        child_outputs.close()
        self.on_death: Callable[[], None] | None = None
        """Called from the reader thread when the core process is gone (not after shutdown())."""
        self.on_news: Callable[[], None] | None = None
        """Called from the reader thread after news (or the death) is queued for ``step()``: a
        data-parallel client waits on several cores at once (memwall/engine/dp_client.py)."""
        self._closing = False
        self._failure: str | None = None  # the core's own last word ("failed" message)
        self._news: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: set[str] = set()  # sample ids sent and not yet seen finished or aborted
        self._sent = self._applied = 0  # messages sent / applied by the core (from its replies)
        self._dead = False  # set by the reader thread as the pipe closes
        self._death = ""  # why, once dead
        self._reader: threading.Thread | None = None
        self.live = LiveTrace()
        """The core's recent steps and block map, as they arrive (the live dashboard)."""
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the child
        try:
            self.info, self._stats = self._wait_ready()
        except BaseException:  # a load error, or Ctrl-C while loading
            self.shutdown(timeout=1.0)
            raise
        self._reader = threading.Thread(target=self._read, name="memwall-core-reader", daemon=True)
        self._reader.start()
        logger.info("engine core process %d ready", self.process.pid)

    def _wait_ready(self) -> tuple[EngineCoreInfo, EngineStats]:
        try:
            kind, *body = self._outputs_pipe.recv()
        except (EOFError, OSError):
            raise EngineCoreStartError(f"the engine core process exited while loading the model "
                                       f"({self._exit_reason()})") from None
        if kind == "failed":
            raise EngineCoreStartError(body[0])
        info, stats = body
        return info, stats

    # ---- CoreClient ------------------------------------------------------------------------
    def add_request(self, first: EngineCoreRequest, forks: list[EngineCoreRequest] = ()) -> None:
        self._inflight.add(first.request_id)
        self._inflight.update(f.request_id for f in forks)
        self._send(("add", first, list(forks)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inflight.difference_update(request_ids)
        self._send(("abort", list(request_ids)))

    def remove_lora(self, lora_int_id: int) -> None:
        self._send(("remove_lora", lora_int_id))

    def set_watched(self, watched: bool) -> None:
        self._send(("watched", watched))

    def has_unfinished_requests(self) -> bool:
        """Requests running, messages the core has not answered yet, or a death to report."""
        return bool(self._inflight) or self._applied < self._sent or self._dead

    def step(self, timeout: float = POLL_S) -> EngineCoreOutputs:
        """The core's news since the last call, merged (empty after ``timeout`` s without any;
        0: do not wait). Raises EngineCoreDeadError once the core process is gone."""
        try:
            items = [self._news.get(timeout=timeout)]
        except queue.Empty:
            return EngineCoreOutputs(stats=self._stats)
        while not self._news.empty():
            items.append(self._news.get_nowait())
        merged = EngineCoreOutputs(stats=self._stats)
        for item in items:
            if item is _DEAD:
                self._news.put(_DEAD)  # and so on every later call
                raise EngineCoreDeadError(self._death)
            outputs, self._applied = item
            merged.outputs.extend(outputs.outputs)
            merged.stats = self._stats = outputs.stats
            if outputs.trace is not None:  # every item's: merging must not drop a step
                self.live.apply(outputs.trace)
        self._inflight.difference_update(o.request_id for o in merged.outputs if o.finished)
        return merged

    def stats(self) -> EngineStats:
        """The stats of the last news received."""
        return self._stats

    def shutdown(self, timeout: float = SHUTDOWN_S) -> None:
        """Asks the core to exit (it finishes its step first); kills it after ``timeout`` s."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        self._send(("shutdown",))
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("engine core process %d did not exit; killing it", self.process.pid)
            self.process.kill()
            self.process.join()
        if self._reader is not None:
            self._reader.join(1.0)  # the pipe is at EOF now: it is leaving
        self._requests.close()
        self._outputs_pipe.close()

    # ---- the process -----------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._sent += 1
        try:
            self._requests.send(message)
        except OSError:  # a dead core: the reader thread reports it through step()
            pass

    def _read(self) -> None:
        """The reader thread: the outputs pipe into a queue until it closes."""
        try:
            while True:
                kind, *body = self._outputs_pipe.recv()
                if kind == "outputs":
                    self._news.put(body)
                    self._notify()
                elif kind == "failed":
                    self._failure = body[0]
        except (EOFError, OSError):
            pass
        if self._closing:  # shutdown() waits for the process itself
            return
        self._death = (f"the engine core process (pid {self.process.pid}) died: "
                       f"{self._failure or self._exit_reason()}")
        self._dead = True
        logger.error("%s", self._death)
        if self.on_death is not None:
            self.on_death()
        self._news.put(_DEAD)
        self._notify()

    def _notify(self) -> None:
        if self.on_news is not None:
            self.on_news()

    def _exit_reason(self) -> str:
        self.process.join(5)  # the pipe closes as the process ends: its status follows at once
        code = self.process.exitcode
        if code is None:
            return "it closed its pipe but is still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"
