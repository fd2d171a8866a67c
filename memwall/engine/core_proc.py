"""The engine core's own process (``memwall serve``): build an EngineCore, then serve it over two
one-way pipes of pickled messages. The API side is memwall/engine/core_client.py.

    API process                                       core process (this file)
    ───────────                                       ────────────
                 <── ("ready", EngineCoreInfo, EngineStats)   EngineCore(args) loaded
                 <── ("failed", one-line message)             ... or the load error, then exit
    ("add", first, forks) ──>                         apply every waiting message,
    ("abort", ids)        ──>                         then step() once if there is work
    ("watched", bool)     ──>                         (a dashboard page opened / all closed)
    ("shutdown",)         ──>                         (EOF on the pipe means the same)
                 <── ("outputs", EngineCoreOutputs, messages applied so far)

After each round (messages applied, one step) one "outputs" message goes back: a step's news,
or just the stats when there was nothing to run (an abort's freed blocks). With no work the
process sleeps on the pipe: no busy spin. It ignores SIGINT and SIGTERM: the server owns its
life (drain first, then "shutdown"); a server that is gone closes the pipe, which ends it too.
"""

from __future__ import annotations

import signal
import sys
import traceback
from multiprocessing.connection import Connection

from memwall.config import EngineArgs

# Errors a user can act on: their message is the whole story, no traceback.
USER_ERRORS = (ValueError, OSError, MemoryError)


class _StepFailed(Exception):
    """The core raised while applying messages or stepping: its state can no longer be trusted."""


def run_engine_core(args: EngineArgs, requests: Connection, outputs: Connection) -> None:
    """The core process's main: load, report "ready" (or "failed"), then serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the server drains, then stops us itself
    from memwall.engine.core import EngineCore  # torch and the model: only in this process

    try:
        core = EngineCore(args)
    except Exception as e:  # noqa: BLE001 - the server prints it and exits
        _report_failure(outputs, e, "cannot start the engine core", plain=USER_ERRORS)
        return
    try:
        outputs.send(("ready", core.info, core.stats()))
        _serve(core, requests, outputs)
    except (EOFError, OSError):  # the pipe: the server is gone
        pass
    except _StepFailed as e:
        _report_failure(outputs, e.__cause__, "the engine core failed")
        sys.exit(1)
    finally:
        core.shutdown()


def _serve(core, requests: Connection, outputs: Connection) -> None:
    """Rounds of: every waiting message applied, one step (or just the stats), one reply."""
    applied = 0
    while True:
        if not core.has_unfinished_requests():
            requests.poll(None)  # asleep until a message (or EOF) arrives
        messages = _receive_waiting(requests)
        if any(kind == "shutdown" for kind, *_ in messages):
            return
        applied += len(messages)
        try:
            for kind, *body in messages:
                getattr(core, HANDLERS[kind])(*body)
            news = core.step() if core.has_unfinished_requests() else core.idle()
        except Exception as e:
            raise _StepFailed() from e
        outputs.send(("outputs", news, applied))


HANDLERS = {"add": "add_request", "abort": "abort_requests", "remove_lora": "remove_lora",
            "watched": "set_watched"}


def _receive_waiting(requests: Connection) -> list[tuple]:
    """Every message already on the pipe (EOFError once the server closed its end)."""
    messages = []
    while requests.poll():
        messages.append(requests.recv())
    return messages


def _report_failure(outputs: Connection, error: BaseException, what: str, plain=()) -> None:
    """Sends the error as one line. ``plain`` errors are the user's (a bad path, too little
    memory): their message says it all; anything else is a bug and leaves its traceback on stderr."""
    if isinstance(error, plain):
        message = _one_line(error)
    else:
        traceback.print_exception(error, file=sys.stderr)
        message = f"{what}: {type(error).__name__}: {_one_line(error)}"
    try:
        outputs.send(("failed", message))
    except OSError:
        pass


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
