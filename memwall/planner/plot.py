"""``memwall plan --plot out.png``: the busiest rank's memory as a stacked bar per plan column,
and decode throughput against batch size with the ridge batch and the batch that fits marked.

matplotlib (the ``plot`` extra) is imported here only, with the Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path

from memwall.planner.plan import Plan

GB = 1e9


def write_plot(plan: Plan, path: str | Path) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'memwall[plot]'") from None
    columns = [("plan", plan), *plan.what_ifs]
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(12, 4.8))
    _memory_bars(bars, columns)
    _throughput(curve, columns)
    s = plan.model.shape
    fig.suptitle(f"{s.name} on {plan.devices} x {plan.device.name}" if plan.device.is_gpu
                 else f"{s.name} on {plan.device.name}")
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ValueError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def _memory_bars(ax, columns: list[tuple[str, Plan]]) -> None:
    parts = ("weights", "activations", "KV at batch", "free", "reserve")
    colors = ("#4c72b0", "#dd8452", "#55a868", "#dddddd", "#999999")
    for x, (_, p) in enumerate(columns):
        m, s = p.memory, p.memory.busiest
        kv = p.batch * m.context_tokens * s.kv_bytes_per_token
        free = max(0, m.usable_bytes - s.weights_bytes - s.activation_bytes - kv)
        sizes = (s.weights_bytes, s.activation_bytes, kv, free, m.capacity_bytes - m.usable_bytes)
        bottom = 0.0
        for label, size, color in zip(parts, sizes, colors):
            ax.bar(x, size / GB, bottom=bottom, color=color, label=label if x == 0 else None)
            bottom += size / GB
        ax.axhline(m.capacity_bytes / GB, color="black", linewidth=0.6)
    ax.set_xticks(range(len(columns)), [text for text, _ in columns])
    ax.set_ylabel("GB per rank (busiest)")
    ax.set_title("memory at the planned batch")
    ax.legend(fontsize=8)


def _throughput(ax, columns: list[tuple[str, Plan]]) -> None:
    for text, p in columns:
        if not p.curve:
            continue
        line, = ax.plot([s.batch for s in p.curve], [s.tokens_per_s for s in p.curve],
                        marker=".", label=text)
        fits = p.memory.max_requests_per_replica
        if fits:
            ax.axvline(fits, color=line.get_color(), linestyle=":", linewidth=1)
        if p.ridge_batch is not None:
            ax.plot([p.ridge_batch], [_at(p, p.ridge_batch)], marker="*", markersize=14,
                    color=line.get_color(), label=f"{text}: ridge B={p.ridge_batch:,.0f}")
        elif p.ridge_batch_weights_only is not None:
            # KV reads keep this context memory-bound: show where the weights alone would turn
            ax.axvline(p.ridge_batch_weights_only, color=line.get_color(), linestyle="--",
                       linewidth=1, label=f"{text}: no ridge at {p.context} tokens; weights-only "
                                          f"ridge B={p.ridge_batch_weights_only:,.0f}")
    if not ax.lines:
        ax.text(0.5, 0.5, "no speeds: calibrate this machine", ha="center", transform=ax.transAxes)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences per replica); dotted: the most that fit")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode throughput vs batch")
    ax.legend(fontsize=8)


def _at(plan: Plan, batch: float) -> float:
    """Throughput at a batch between the curve's points (linear between them)."""
    points = [(s.batch, s.tokens_per_s) for s in plan.curve]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b0 <= batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / max(b1 - b0, 1e-9)
    return points[-1][1]
