"""Where pipeline stages cut a model's layers: pure arithmetic, no torch, so the planner
(memwall/planner/layout.py) predicts exactly the stages the engine builds (pipeline.py)."""

from __future__ import annotations


def balanced_stages(layers: int, stages: int, layer_cost: float,
                    head_cost: float) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, one per stage, every stage at least one layer,
    minimizing the heaviest stage when each layer costs ``layer_cost`` and the last stage also
    carries the LM head's ``head_cost`` (dynamic programming over the cut points)."""
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages need at least {stages} layers; this model "
                         f"has {layers}: use pipeline_parallel_size <= {layers}")
    inf = float("inf")
    # best[s][i]: the smallest possible heaviest stage when stages s.. hold layers i..n-1
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[stages][layers] = 0
    for s in range(stages - 1, -1, -1):
        for i in range(layers - (stages - s), -1, -1):
            for j in range(i + 1, layers - (stages - s - 1) + 1):
                cost = (j - i) * layer_cost + (head_cost if s == stages - 1 else 0)
                worst = max(cost, best[s + 1][j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    bounds, start = [], 0
    for s in range(stages):
        stop = cut[s][start]
        bounds.append((start, stop))
        start = stop
    return bounds
