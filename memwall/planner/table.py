"""A Plan as aligned text: a heading, one row per figure, a column per what-if, then notes.
GB are decimal (1e9), as GPU vendors state memory."""

from __future__ import annotations

from typing import Callable

from memwall.planner.plan import Plan

GB = 1e9


def plan_table(plan: Plan) -> str:
    columns = [("plan", plan), *plan.what_ifs]
    rows = [(label, [cell(p) for _, p in columns]) for label, cell in ROWS]
    width = max(len(label) for label, _ in ROWS) + 2
    col = max(12, *(len(text) + 2 for text, _ in columns),
              *(len(v) + 2 for _, values in rows for v in values))
    lines = _heading(plan) + [""]
    lines.append(" " * width + "".join(text.rjust(col) for text, _ in columns))
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in values) for label, values in rows]
    for text, p in columns:
        prefix = "" if text == "plan" else f"[{text}] "
        lines += [f"note: {prefix}{note}" for note in p.notes]
    return "\n".join(lines)


def _heading(plan: Plan) -> list[str]:
    s, d, lay = plan.model.shape, plan.device, plan.layout
    speed = ("bandwidth unknown" if d.bandwidth_bytes_s is None else
             f"{d.bandwidth_bytes_s / 1e12:.3g} TB/s x {d.bandwidth_efficiency:g}")
    count = f"{plan.devices} x " if d.is_gpu else ""
    return [f"{s.name} ({plan.model.source.split(':')[0]}, {s.params / 1e9:.3g}B params, "
            f"{s.layers} layers, {s.kv_heads}/{s.heads} KV/q heads of {s.head_dim})",
            f"on {count}{d.name}: {d.memory_bytes / GB:.1f} GB, {speed}",
            f"weights {plan.weights.label}, KV cache {plan.kv_dtype}, context {plan.context}, "
            f"TP {lay.tensor_parallel} x PP {lay.pipeline_parallel}, {lay.replicas} replica(s)"]


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _speed(fn: Callable[[Plan], str]) -> Callable[[Plan], str]:
    return lambda p: "n/a" if p.decode is None else fn(p)


def _ridge(p: Plan) -> str:
    if p.ridge_batch is None:
        return "none (memory-bound)"
    return f"{p.ridge_batch:,.0f}"


def _ridge_intensity(p: Plan) -> float:
    """The device's FLOP/s over its bandwidth: a step above this intensity is compute-bound."""
    return p.decode_model.flops / p.decode_model.bandwidth


ROWS: list[tuple[str, Callable[[Plan], str]]] = [
    ("weights (all ranks)", lambda p: _gb(p.weights.total_bytes)),
    ("weights / rank", lambda p: _gb(p.memory.busiest.weights_bytes)),
    ("KV / token / rank", lambda p: f"{p.memory.busiest.kv_bytes_per_token:,} B"),
    ("KV / request / rank", lambda p: _gb(p.memory.busiest.kv_bytes_per_token
                                          * p.memory.context_tokens)),
    ("activations / rank", lambda p: _gb(p.memory.busiest.activation_bytes)),
    ("usable / rank", lambda p: f"{_gb(p.memory.usable_bytes)} "
                                f"({1 - p.memory.reserve_fraction:.0%})"),
    ("fits", lambda p: "yes" if p.memory.fits else "NO"),
    ("max concurrent requests", lambda p: f"{p.memory.max_requests:,}"),
    ("batch (per replica)", lambda p: f"{p.batch:,}"),
    ("weights read / step / rank", _speed(lambda p: _gb(p.decode_model.weights_bytes))),
    ("decode step", _speed(lambda p: f"{_ms(p.decode.step_s)} ({p.decode.bound})")),
    ("decode tok/s", _speed(lambda p: _rate(p.decode.tokens_per_s))),
    ("tok/s per sequence", _speed(lambda p: _rate(p.decode.tokens_per_s_per_sequence))),
    ("tok/s per sequence, B=1", _speed(lambda p: _rate(p.decode_one.tokens_per_s_per_sequence))),
    ("arithmetic intensity", _speed(lambda p: f"{p.decode.arithmetic_intensity:,.1f} FLOP/B "
                                              f"(ridge {_ridge_intensity(p):,.0f})")),
    ("ridge batch", _speed(_ridge)),
    ("ridge batch, weights only", _speed(lambda p: "none" if p.ridge_batch_weights_only is None
                                         else f"{p.ridge_batch_weights_only:,.0f}")),
    ("TTFT", _speed(lambda p: f"{_ms(p.prefill.ttft_s)} @{p.prompt}")),
    ("prefill tok/s", _speed(lambda p: _rate(p.prefill.tokens_per_s))),
    ("$ / 1M output tokens", lambda p: "n/a" if p.usd_per_million_tokens is None
                                       else f"{p.usd_per_million_tokens:.3f}"),
]
