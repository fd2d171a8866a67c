"""A live memwall server on 127.0.0.1 (uvicorn in a background thread) over the tiny model.

One server with an API key, its engine core in a process of its own as under ``memwall serve``,
is shared by the whole folder (``server``); tests that need other limits start their own with
``LiveServer`` (in-process by default, so they can reach into the engine). ``offline`` is a
separate in-process ``LLM`` with the same engine settings: the oracle that greedy server outputs
must equal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key"
ENGINE_ARGS = dict(num_kv_blocks=512, block_size=16, max_model_len=512, max_num_seqs=64, threads=1)


@dataclass
class LiveServer:
    """A real uvicorn server bound to a free port; stop() shuts it down gracefully."""

    url: str
    engine: object  # AsyncLLMEngine
    uvicorn: object
    thread: threading.Thread
    api_key: str | None = None

    @classmethod
    def start(cls, model_dir, api_key: str | None = None, max_queue: int | None = None,
              served_model_names: list[str] | None = None, core_process: bool = False,
              tools=None, lora_modules=None, **engine_args) -> "LiveServer":
        """``core_process``: the engine core in a process of its own, as under ``memwall serve``
        (default: in this process, so tests can reach into it). ``lora_modules``: LoRAModulePath
        entries (--lora-modules; needs enable_lora=True)."""
        from memwall.config import EngineArgs
        from memwall.entrypoints.openai.server import (ServerSettings, build_app, build_engine,
                                                       server_socket, uvicorn_server)

        model = None if model_dir is None else str(model_dir)  # None: the embedded model
        args = EngineArgs(model=model, **{**ENGINE_ARGS, **engine_args})
        engine = build_engine(args, core_process)
        settings = ServerSettings(served_model_names=served_model_names or [], api_key=api_key,
                                  max_queue=max_queue, **({"tools": tools} if tools else {}),
                                  lora_modules=list(lora_modules or []))
        server = uvicorn_server(build_app(engine, settings), log_level="warning")
        sock = server_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return cls(f"http://127.0.0.1:{port}", engine, server, thread, api_key)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **{"timeout": 60, **kwargs})

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (0.0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no KV blocks and runs nothing (asserts it happens in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats
            parked = stats.lora.parked_blocks if stats.lora is not None else 0  # adapters' weights
            if stats.num_free_blocks + parked == stats.num_total_blocks and not stats.num_running:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine did not become idle: {self.engine.stats}")

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def server(model_dir):
    # The engine core in its own process, as `memwall serve` runs it: every test through this
    # server crosses the process boundary (and must equal the in-process `offline` oracle).
    live = LiveServer.start(model_dir, api_key=API_KEY, served_model_names=["tiny", "tiny-alias"],
                            core_process=True)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def start_server():
    """Factory for extra servers with other limits: start_server(model_dir, max_queue=1, ...)."""
    return LiveServer.start


@pytest.fixture(scope="session")
def offline(model_dir):
    from memwall import LLM

    return LLM(str(model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="session")
def text_of(offline):
    """An offline sample's full text, as the detokenizer's contract defines it (no stop strings).

    Not ``sample.text``: the engine reads it before the detokenizer's final flush, so it can lack
    a trailing incomplete character that the streamed deltas (and the server) do include.
    """
    return lambda sample: offline.tokenizer.decode(sample.token_ids)
