"""How a model is cut over ranks, as memwall/distributed/ cuts it (without importing it:
that package imports torch; tests/planner/test_layout.py checks the two agree).

    tensor parallel (TP)   every layer's heads, KV heads, MLP columns and vocabulary rows are
                           split over TP ranks; with fewer KV heads than ranks each KV head
                           (and its k/v weights) is replicated on TP / g ranks
    pipeline parallel (PP) contiguous runs of layers, one per stage, balanced on decode reads
                           (the LM head counted with the last stage, the embedding not: decode
                           reads one row of it); the first stage holds the embedding, the last
                           the final norm and LM head (and the embedding again when tied)
    replicas               GPUs beyond TP x PP hold whole copies (data parallel)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memwall.distributed.stage_split import balanced_stages
from memwall.planner.shapes import ModelShape


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    devices: int = 1
    """GPUs (or hosts) in all; devices / (TP x PP) replicas serve requests side by side."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.devices % self.ranks:
            raise ValueError(f"{self.devices} GPUs cannot hold replicas of tensor_parallel_size "
                             f"{self.tensor_parallel} x pipeline_parallel_size "
                             f"{self.pipeline_parallel} = {self.ranks} ranks: give a multiple of "
                             f"{self.ranks} GPUs (e.g. --gpu H100x{self.ranks})")

    @property
    def ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def replicas(self) -> int:
        return self.devices // self.ranks


@dataclass(frozen=True)
class RankShare:
    """What one tensor-parallel rank holds of a layer and of the vocabulary (the largest
    rank's share where the split is uneven)."""

    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    layer_fraction: float
    """Its share of one layer's matrix weights (1/TP when everything divides)."""
    vocab_fraction: float


def rank_share(shape: ModelShape, tp: int) -> RankShare:
    """The largest TP rank's share; ValueError (the engine's rule) where heads cannot split."""
    g, group = shape.kv_heads, shape.heads // shape.kv_heads
    if g >= tp:
        heads, kv = math.ceil(g / tp) * group, math.ceil(g / tp)
    elif tp % g or group % (tp // g):
        raise ValueError(f"{g} KV heads of {group} query heads each cannot be shared by {tp} "
                         f"ranks: use tensor_parallel_size {g} or a divisor of it")
    else:
        heads, kv = group // (tp // g), 1
    if shape.intermediate < tp or shape.vocab < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's MLP or vocabulary size")
    inter, vocab = math.ceil(shape.intermediate / tp), math.ceil(shape.vocab / tp)
    h, d = shape.hidden, shape.head_dim
    rank_params = h * d * (2 * heads + 2 * kv) + 3 * h * inter
    return RankShare(heads, kv, inter, vocab, rank_params / shape.layer_matrix_params(),
                     vocab / shape.vocab)


def stage_layers(shape: ModelShape, stages: int) -> list[tuple[int, int]]:
    """[start, stop) layers per stage, minimizing the heaviest stage's decode reads (every
    layer's matrices; the LM head with the last stage): the engine's own rule and code."""
    return balanced_stages(shape.layers, stages, shape.layer_matrix_params(),
                           shape.vocab * shape.hidden)
