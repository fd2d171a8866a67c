"""Prometheus metrics for GET /metrics, in a registry of the server's own (not the global one, so
two servers in one process, as in tests, do not collide).

Three sources feed it:
* ``RequestTracker``: one per engine request, fed each RequestOutput as the serving code reads it
  (TTFT, inter-token latency, end-to-end latency, tokens, finish reason);
* ``HTTPMetricsMiddleware``: the HTTP status of every response;
* ``EngineCollector``: the engine's latest ``EngineStats`` snapshot, read at scrape time (running
  and waiting requests, KV-cache usage, preemptions, and with --enable-lora the adapters' loads,
  evictions and per-adapter prefix-cache hit rates), so nothing polls the engine in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from memwall.engine.async_engine import AsyncLLMEngine
from memwall.engine.protocol import LoRAStatsSnapshot
from memwall.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter("memwall:http_requests", "HTTP responses by route and status",
                                     ["path", "status"], registry=reg)
        self.request_success = Counter("memwall:request_success",
                                       "Finished completions (one per choice) by finish reason",
                                       ["finished_reason"], registry=reg)
        self.prompt_tokens = Counter("memwall:prompt_tokens", "Prefilled prompt tokens", registry=reg)
        self.generation_tokens = Counter("memwall:generation_tokens", "Generated tokens", registry=reg)
        self.ttft = Histogram("memwall:time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("memwall:inter_token_latency_seconds", "Time between streamed outputs",
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("memwall:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=E2E_BUCKETS, registry=reg)
        reg.register(EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for the /metrics response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, arrival: float | None = None) -> "RequestTracker":
        return RequestTracker(self, arrival if arrival is not None else time.monotonic())


@dataclass
class RequestTracker:
    """Latency and token accounting for one engine request (all n of its samples)."""

    metrics: ServerMetrics
    arrival: float
    last_token_time: float | None = None
    done: bool = False
    num_prompt_tokens: int = 0
    num_generated: dict[int, int] = field(default_factory=dict)

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        self.num_prompt_tokens = len(output.prompt_token_ids)
        if any(c.delta_token_ids for c in output.outputs):
            if self.last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - self.last_token_time)
            self.last_token_time = now
        for c in output.outputs:
            self.num_generated[c.index] = len(c.token_ids)
        if output.finished:
            self._finish([c.finish_reason or "abort" for c in output.outputs], now)

    def close(self) -> None:
        """Call when the consumer stops; a request that never finished counts as aborted."""
        if not self.done:
            self._finish(["abort"] * max(1, len(self.num_generated)), time.monotonic())

    def _finish(self, reasons: list[str], now: float) -> None:
        if self.done:
            return
        self.done = True
        for reason in reasons:
            self.metrics.request_success.labels(finished_reason=reason).inc()
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(sum(self.num_generated.values()))
        self.metrics.e2e.observe(now - self.arrival)


class EngineCollector:
    """Engine gauges computed at scrape time from the engine thread's latest snapshot."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        gauges = {
            "memwall:num_requests_running": ("Sequences running in the engine", stats.num_running),
            "memwall:num_requests_waiting": ("Sequences waiting to be scheduled", self.engine.num_waiting),
            "memwall:kv_cache_usage_perc": ("Share of KV-cache blocks in use (0..1)", stats.kv_cache_usage),
            "memwall:kv_cache_free_blocks": ("Free KV-cache blocks", stats.num_free_blocks),
            "memwall:kv_cache_total_blocks": ("KV-cache blocks in all", stats.num_total_blocks),
            "memwall:prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / looked up",
                                              stats.prefix_cache_hit_rate),
            "memwall:spec_decode_acceptance_rate": ("Draft tokens accepted / verified",
                                                    stats.spec_acceptance_rate),
            "memwall:spec_decode_mean_accepted_length": (
                "Tokens per verifying step (accepted drafts + 1)", stats.spec_mean_accepted_length),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        yield CounterMetricFamily("memwall:num_preemptions", "Requests preempted so far",
                                  value=stats.num_preemptions)
        by_mode = CounterMetricFamily("memwall:preemptions_by_mode", "Preemptions by mode", labels=["mode"])
        by_mode.add_metric(["recompute"], stats.num_preemptions_recompute)
        by_mode.add_metric(["swap"], stats.num_preemptions_swap)
        yield by_mode
        counters = {
            "memwall:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                             stats.prefix_cache_queries),
            "memwall:prefix_cache_hits": ("Prompt tokens whose KV came from the prefix cache",
                                          stats.prefix_cache_hits),
            "memwall:prefix_cache_evictions": ("Cached KV blocks evicted", stats.prefix_cache_evictions),
            "memwall:spec_decode_num_draft_tokens": ("Draft tokens verified (speculative decoding)",
                                                     stats.spec_num_draft_tokens),
            "memwall:spec_decode_num_accepted_tokens": ("Draft tokens accepted",
                                                        stats.spec_num_accepted_tokens),
            "memwall:spec_decode_num_drafts": ("Sequence-steps that verified drafts",
                                               stats.spec_num_verify_steps),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(name, help_text, value=value)
        if stats.lora is not None:
            yield from lora_metrics(stats.lora)


def lora_metrics(lora: LoRAStatsSnapshot):
    """Multi-LoRA: the host caches' loads, evictions and residents, and per adapter (labelled
    by its name) requests and prefix-cache hit rate."""
    yield CounterMetricFamily("memwall:lora_adapter_loads",
                              "LoRA adapters read from disk into the host caches", value=lora.loads)
    yield CounterMetricFamily("memwall:lora_adapter_evictions",
                              "LoRA adapters dropped from the host caches to make room",
                              value=lora.evictions)
    yield GaugeMetricFamily("memwall:lora_adapters_resident",
                            "LoRA adapters in the host caches now", value=lora.resident)
    yield GaugeMetricFamily("memwall:lora_cached_blocks_not_resident_ratio",
                            "Share of the prefix cache's adapter blocks whose adapter is not in "
                            "the host caches (0..1)", value=lora.not_resident_share)
    requests = CounterMetricFamily("memwall:lora_requests", "Requests by LoRA adapter",
                                   labels=["adapter"])
    hit_rate = GaugeMetricFamily("memwall:lora_prefix_cache_hit_rate",
                                 "Prompt tokens served from the prefix cache / looked up, by LoRA "
                                 "adapter", labels=["adapter"])
    queries = CounterMetricFamily("memwall:lora_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache, by LoRA adapter",
                                  labels=["adapter"])
    hits = CounterMetricFamily("memwall:lora_prefix_cache_hits",
                               "Prompt tokens whose KV came from the prefix cache, by LoRA adapter",
                               labels=["adapter"])
    for adapter in lora.adapters:
        requests.add_metric([adapter.name], adapter.requests)
        hit_rate.add_metric([adapter.name], adapter.prefix_hit_rate)
        queries.add_metric([adapter.name], adapter.prefix_queries)
        hits.add_metric([adapter.name], adapter.prefix_hits)
    yield from (requests, hit_rate, queries, hits)


class HTTPMetricsMiddleware:
    """Pure ASGI middleware counting responses by path and status (streaming-safe)."""

    def __init__(self, app, metrics: ServerMetrics, known_paths: set[str]) -> None:
        self.app, self.metrics, self.known_paths = app, metrics, known_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # Unknown paths share one label, so that scanners cannot blow up the series count.
        path = scope.get("path", "")
        label = path if path in self.known_paths else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(path=label, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
