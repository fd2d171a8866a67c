"""What a serving run measured, summed up: percentiles, throughput, goodput under SLOs, tables.

Definitions follow vLLM's ``benchmark_serving`` (client side, streaming):

    TTFT   send -> first streamed token (queueing + prefill + network)
    TPOT   per request: (E2EL - TTFT) / (output_tokens - 1)
    ITL    every gap between two consecutive token-carrying chunks, pooled across requests
    E2EL   send -> last token
    goodput  requests/s that met every SLO given (DistServe, arXiv 2401.09670)

Nothing here does I/O; `summarize` takes the per-request results of `loadgen.run_load`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    NaN for an empty sequence, so a run with no successful request still prints a table.
    """
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class SLO:
    """Per-request service-level objectives in milliseconds; None means "not constrained"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
        """True when every given objective holds (times in seconds, objectives in ms)."""
        checks = ((self.ttft_ms, ttft_s), (self.tpot_ms, tpot_s), (self.e2el_ms, e2el_s))
        return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency metric, in milliseconds."""

    mean_ms: float
    percentiles_ms: dict[str, float]  # "p50" -> value
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Iterable[float]) -> Distribution:
        ms = [s * 1000.0 for s in seconds]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(mean, {_pname(p): percentile(ms, p) for p in percentiles}, len(ms))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """One run's summary; `asdict` gives the JSON form."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float      # completed requests / s
    output_throughput: float       # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    achieved_concurrency: float    # sum of request latencies / wall time (SGLang's "concurrency")
    goodput: float | None          # requests / s within every SLO; None without SLOs
    slo_attainment: float | None   # share of completed requests within every SLO
    short_outputs: int             # completed with fewer tokens than asked (EOS, or no ignore_eos)
    latency: dict[str, Distribution] = field(default_factory=dict)  # ttft, tpot, itl, e2el

    def to_dict(self) -> dict:
        return asdict(self)


def tpot_of(result) -> float:
    """Seconds per output token after the first; 0 for a request with at most one token."""
    if result.output_tokens <= 1:
        return 0.0
    return (result.e2el - result.ttft) / (result.output_tokens - 1)


def summarize(results: Sequence, duration_s: float, slo: SLO = SLO(),
              percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> BenchmarkMetrics:
    """Aggregate `loadgen.RequestResult`s of one run that took `duration_s` seconds of wall time."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    tpots = [tpot_of(r) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(slo.met_by(r.ttft, tpot_of(r), r.e2el) for r in ok) if slo.any else None
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots,
              "itl": [gap for r in ok for gap in r.itl], "e2el": [r.e2el for r in ok]}
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=per_s(len(ok)), output_throughput=per_s(out_tokens),
        total_token_throughput=per_s(in_tokens + out_tokens),
        achieved_concurrency=per_s(sum(r.e2el for r in ok)),
        goodput=None if good is None else per_s(good),
        slo_attainment=None if good is None else (good / len(ok) if ok else math.nan),
        short_outputs=sum(r.output_tokens < r.expected_output_len for r in ok),
        latency={name: Distribution.of(values, percentiles) for name, values in series.items()})


# ---- tables ------------------------------------------------------------------------------------
def metric_rows(m: BenchmarkMetrics) -> list[tuple[str, float | None, bool]]:
    """(label, value, higher_is_better) rows in display order; latencies in ms."""
    rows = [("completed requests", m.completed, True), ("failed requests", m.failed, False),
            ("duration (s)", m.duration_s, False),
            ("request throughput (req/s)", m.request_throughput, True),
            ("output throughput (tok/s)", m.output_throughput, True),
            ("total throughput (tok/s)", m.total_token_throughput, True),
            ("achieved concurrency", m.achieved_concurrency, True)]
    if m.goodput is not None:
        rows += [("goodput (req/s)", m.goodput, True),
                 ("SLO attainment (%)", 100.0 * m.slo_attainment, True)]
    for name in LATENCY_METRICS:
        dist = m.latency[name]
        rows.append((f"{name.upper()} mean (ms)", dist.mean_ms, False))
        rows += [(f"{name.upper()} {p} (ms)", v, False) for p, v in dist.percentiles_ms.items()]
    return rows


def format_table(m: BenchmarkMetrics, title: str = "") -> str:
    """One run as a two-column table."""
    lines = [f"{title:=^58}"] if title else []
    lines += [f"{label:<36}{_fmt(value):>22}" for label, value, _ in metric_rows(m)]
    if m.short_outputs:
        lines.append(f"note: {m.short_outputs} requests stopped before max_tokens (EOS or a stop;"
                     " with ignore_eos on, the server did not honour it)")
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing or b is zero."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def format_comparison(metrics: dict[str, BenchmarkMetrics], title: str = "") -> str:
    """Engines side by side, with a last column first/second (e.g. memwall / llama.cpp).

    The ratio column reads: for throughput > 1 means the first engine is faster; for latency
    > 1 means it is slower.
    """
    names = list(metrics)
    columns = {name: metric_rows(m) for name, m in metrics.items()}
    head = f"{'metric':<32}" + "".join(f"{n:>14}" for n in names)
    if len(names) == 2:
        head += f"{names[0] + '/' + names[1]:>22}"
    lines = [f"{title:=^{len(head)}}"] if title else []
    lines.append(head)
    for i, (label, _, _) in enumerate(columns[names[0]]):
        values = [columns[n][i][1] if i < len(columns[n]) else None for n in names]
        line = f"{label:<32}" + "".join(f"{_fmt(v):>14}" for v in values)
        if len(names) == 2:
            line += f"{_fmt_ratio(ratio(values[0], values[1])):>22}"
        lines.append(line)
    return "\n".join(lines)


def _pname(p: float) -> str:
    return f"p{p:g}"


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "nan"
    return f"{value:.2f}"


def _fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"
