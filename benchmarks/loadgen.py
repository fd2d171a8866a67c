"""The load generator: streaming POST /v1/completions against any OpenAI-compatible server.

One asyncio loop, one httpx client, so the client stays light next to a CPU-bound server.
Every request is timed chunk by chunk:

    send      first token      token      token  ...  last token     [finish] [usage] [DONE]
     |------------|-----------|----------|------------|
     |<-- TTFT -->|<-- ITL -->|<-- ITL ->|   ...      |
     |<---------------------- E2EL ------------------>|

A "token chunk" is an SSE event whose first choice carries text. A chunk with only a
finish_reason (llama.cpp sends one) or only usage is not a token. The output token count is
the server's `usage.completion_tokens` (we ask for it with `stream_options.include_usage`),
else the number of token chunks.

Arrivals: all at once (`request_rate=inf`), or Poisson at `request_rate` req/s (gamma with
`burstiness` != 1); `concurrency` caps requests in flight (closed loop when the rate is inf).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import httpx

from benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    """What one request measured; times in seconds from its own send."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_tokens: int = 0       # usage.completion_tokens, else token chunks
    chunks: int = 0              # token chunks; fewer than output_tokens when a chunk has several
    server_prompt_tokens: int = 0  # usage.prompt_tokens (checks the prompt length; BOS included)
    start: float = 0.0           # send time relative to the run's start
    text: str = ""

    def to_dict(self, with_text: bool = False) -> dict:
        data = asdict(self)
        if not with_text:
            data.pop("text")
        return data


@dataclass(frozen=True)
class LoadConfig:
    """How to send a run's requests."""

    base_url: str
    model: str | None = None       # served model name; None asks /v1/models
    concurrency: int | None = None  # most requests in flight; None = no cap
    request_rate: float = math.inf  # req/s; inf sends all at once
    burstiness: float = 1.0        # 1 = Poisson; < 1 burstier, > 1 more even (gamma intervals)
    seed: int = 0
    ignore_eos: bool = True        # fixed output length: ignore_eos + min_tokens = max_tokens
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)


def completion_payload(cfg: LoadConfig, model: str | None, req: SampleRequest) -> dict:
    """The JSON body of one streaming /v1/completions request."""
    body = {"prompt": req.prompt, "max_tokens": req.expected_output_len,
            "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if cfg.ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.expected_output_len)
    body.update(cfg.extra_body)
    return body


async def send_request(client: httpx.AsyncClient, url: str, payload: dict,
                       result: RequestResult) -> RequestResult:
    """POST one streaming completion and time its chunks into `result` (also returned).

    Never raises for server trouble: an HTTP error, an SSE error event, a broken stream or a
    timeout leave `success` False and `error` saying what happened.
    """
    t0 = time.perf_counter()
    last, done = t0, False
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for data in _sse_data(response):
                now = time.perf_counter()
                if data is DONE:
                    done = True
                elif _is_token_chunk(data, result):
                    if result.chunks == 0:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
        if result.chunks == 0:  # the model stopped at once (EOS first): no token to wait for
            last = time.perf_counter()
            result.ttft = last - t0
        result.e2el = last - t0
        result.output_tokens = result.output_tokens or result.chunks
        if not done and not result.error:
            result.error = "the stream ended without data: [DONE] (server died mid-reply?)"
        result.success = not result.error
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


DONE = object()  # what _sse_data yields for `data: [DONE]`


async def _sse_data(response: httpx.Response):
    """Yield the parsed JSON of each `data:` event, and DONE last for `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield DONE
            return
        yield json.loads(data)


def _is_token_chunk(data: dict, result: RequestResult) -> bool:
    """Record usage and errors from one event into `result`; True when it carries text."""
    if "error" in data:
        error = data["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return False
    usage = data.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.server_prompt_tokens = int(usage.get("prompt_tokens") or 0)
    choices = data.get("choices") or []
    text = (choices[0].get("text") or "") if choices else ""
    result.text += text
    return bool(text)


# ---- arrivals and the run ----------------------------------------------------------------------
def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0,
                 rng: random.Random | None = None) -> list[float]:
    """Seconds to wait before each of `n` requests: gamma intervals with mean 1/rate
    (exponential, i.e. Poisson arrivals, at burstiness 1); all zero at an infinite rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {request_rate}, "
                         f"{burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = rng or random.Random(0)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id /v1/models lists, or None when the route is missing."""
    try:
        response = await client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def make_client(cfg: LoadConfig, n_requests: int) -> httpx.AsyncClient:
    """One pooled client; trust_env=False so a proxy variable never reroutes 127.0.0.1."""
    pool = cfg.concurrency or n_requests
    limits = httpx.Limits(max_connections=pool + 2, max_keepalive_connections=pool + 2)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits,
                             trust_env=False)


async def run_load(cfg: LoadConfig, requests: Sequence[SampleRequest],
                   warmup: Sequence[SampleRequest] = ()) -> tuple[list[RequestResult], float]:
    """Send `requests` as `cfg` says; return their results (in input order) and the wall time
    from the first send to the last completion. `warmup` requests go first, all at once (so
    several warm batched shapes too), and are not measured; one failing aborts the run."""
    url = f"{cfg.base_url.rstrip('/')}/v1/completions"
    async with make_client(cfg, max(len(requests), len(warmup))) as client:
        model = cfg.model or await resolve_model(client, cfg.base_url.rstrip("/"))
        warm = await asyncio.gather(*(
            send_request(client, url, completion_payload(cfg, model, req),
                         RequestResult(req.prompt_len, req.expected_output_len))
            for req in warmup))
        failed = [r.error for r in warm if not r.success]
        if failed:
            raise RuntimeError(f"warm-up request to {url} failed: {failed[0]}")
        return await _timed_run(cfg, client, url, model, requests)


async def _timed_run(cfg: LoadConfig, client: httpx.AsyncClient, url: str, model: str | None,
                     requests: Sequence[SampleRequest]) -> tuple[list[RequestResult], float]:
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, random.Random(cfg.seed))
    start = time.perf_counter()

    async def one(req: SampleRequest) -> RequestResult:
        result = RequestResult(req.prompt_len, req.expected_output_len)
        if gate is None:
            result.start = time.perf_counter() - start
            return await send_request(client, url, completion_payload(cfg, model, req), result)
        async with gate:  # sleep-then-gate: a late slot delays the send, no catch-up burst
            result.start = time.perf_counter() - start
            return await send_request(client, url, completion_payload(cfg, model, req), result)

    tasks = []
    for req, gap in zip(requests, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start
