"""Will it fit: weights, KV cache, activations and the reserve on the busiest rank, and how many
requests at full context the rest holds.

    usable        = capacity x (1 - reserve)                 reserve: 20% held back for the
                                                             runtime (CUDA context, allocator
                                                             slack, fragmentation); settable
    weights       = the stage's layers x the rank's share + the embedding (first stage; the last
                    too when tied) + LM head and final norm (last stage), vocabulary / TP
    KV / token    = 2 x stage layers x KV heads of the rank x bytes per token and head
                    (precision.kv_bytes_per_token_head: int8 adds its scale)
    activations   = step tokens T x compute bytes x max(attention, MLP) live values a token
                    + (last stage) sampled rows R x vocab x 4 bytes x 2
                        attention: 2 H + (h_r + 2 g_r) D + h_r D   (x, normed x, qkv, output)
                        MLP:       2 H + 3 I_r                     (x, normed x, gate_up, act)
                    T = --max-num-batched-tokens (the engine's step budget, 2048), R = min(T,
                    256): float32 logits and the sampler's probabilities. One layer's
                    temporaries are live at a time; the engine profiles the same forward pass
                    (memwall/worker/device.py profile_gpu_memory).
    requests      = floor((usable - weights - activations) / (KV / token x context)),
                    the context rounded up to whole 16-token KV blocks, the smallest over stages

Llama-3-8B, bf16, one 80 GB GPU, 4096-token context: usable 64e9, weights 16,060,522,496,
activations 2048 x 2 x 51,200 + 256 x 128,256 x 8 = 472,383,488, KV 131,072 B/token ->
47,467,094,016 / 536,870,912 = 88 requests (89 ignoring activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memwall.config import DEFAULT_BLOCK_SIZE, DEFAULT_STEP_BUDGET
from memwall.planner.layout import Layout, RankShare, rank_share, stage_layers
from memwall.planner.precision import kv_bytes_per_token_head, precision
from memwall.planner.shapes import ModelShape
from memwall.planner.sources import ModelSource

DEFAULT_RESERVE = 0.2
DEFAULT_STEP_TOKENS = DEFAULT_STEP_BUDGET  # the engine's step budget on cuda
SAMPLE_ROWS = 256  # rows of logits a step samples at most (vLLM's default max_num_seqs)
BLOCK_SIZE = DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class Weights:
    """A model's weight bytes in the groups that ranks hold."""

    layer_bytes: tuple[int, ...]
    embedding_bytes: int
    head_bytes: int
    other_bytes: int
    label: str
    """bf16, or Q4_1 x210 + F32 x61 + Q8_0 x1 (a GGUF file), or int4 layers + bf16."""

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes + self.other_bytes


def model_weights(model: ModelSource, compute: str, quantization: str) -> Weights:
    """``auto``: a GGUF file's own tensors (exact), else every weight in ``compute``;
    ``none``: all in ``compute``; a format: the layers' matrices in it, the rest in ``compute``."""
    shape, gguf = model.shape, model.gguf
    if quantization == "auto" and gguf is not None:
        label = " + ".join(f"{t} x{n}" for t, n in sorted(gguf.types.items(), key=lambda x: -x[1]))
        return Weights(gguf.layer_bytes, gguf.embedding_bytes, gguf.head_bytes, gguf.other_bytes,
                       label)
    e = precision(compute).bytes_per_value
    matrix = e if quantization in ("auto", "none") else precision(quantization).bytes_per_value
    layer = round(shape.layer_matrix_params() * matrix + shape.layer_vector_params() * e)
    label = compute if matrix == e else f"{precision(quantization).name} layers + {compute}"
    return Weights((layer,) * shape.layers, round(shape.embedding_params() * e),
                   round(shape.head_params() * e), round(shape.hidden * e), label)


@dataclass(frozen=True)
class StageMemory:
    """One rank of a pipeline stage (every TP rank of a stage holds the same amounts)."""

    layers: tuple[int, int]
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int


def stage_memory(shape: ModelShape, weights: Weights, layout: Layout, kv_dtype: str,
                 compute_bytes: float, step_tokens: int) -> list[StageMemory]:
    share = rank_share(shape, layout.tensor_parallel)
    bounds = stage_layers(shape, layout.pipeline_parallel)
    per_head = kv_bytes_per_token_head(kv_dtype, shape.head_dim)
    out = []
    for index, (start, stop) in enumerate(bounds):
        first, last = index == 0, index == len(bounds) - 1
        vocab = weights.embedding_bytes * (first or (last and shape.tied_embeddings))
        vocab += (weights.head_bytes + weights.other_bytes) * last
        held = sum(weights.layer_bytes[start:stop]) * share.layer_fraction
        held += vocab * share.vocab_fraction
        kv = 2 * (stop - start) * share.kv_heads * per_head
        act = activation_bytes(shape, share, compute_bytes, step_tokens, last)
        out.append(StageMemory((start, stop), round(held), kv, act))
    return out


def activation_bytes(shape: ModelShape, share: RankShare, compute_bytes: float,
                     step_tokens: int, last_stage: bool) -> int:
    """Peak live activations of one step (formula in the module docstring)."""
    h, d = shape.hidden, shape.head_dim
    attention = 2 * h + (share.heads + 2 * share.kv_heads) * d + share.heads * d
    mlp = 2 * h + 3 * share.intermediate
    hidden = step_tokens * compute_bytes * max(attention, mlp)
    logits = min(step_tokens, SAMPLE_ROWS) * shape.vocab * 4 * 2 if last_stage else 0
    return round(hidden + logits)


@dataclass(frozen=True)
class MemoryPlan:
    capacity_bytes: int
    """One device's memory (a host's share per rank on the CPU)."""
    reserve_fraction: float
    stages: list[StageMemory]
    context_tokens: int
    """The context every request is planned at, in whole KV blocks."""
    replicas: int

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.reserve_fraction))

    def _budget(self, stage: StageMemory) -> int:
        return self.usable_bytes - stage.weights_bytes - stage.activation_bytes

    @property
    def busiest(self) -> StageMemory:
        """The stage with the least room left for KV per request."""
        return min(self.stages, key=lambda s: self._budget(s) / s.kv_bytes_per_token)

    @property
    def fits(self) -> bool:
        return all(self._budget(s) > 0 for s in self.stages)

    @property
    def max_requests_per_replica(self) -> int:
        return max(0, min(self._budget(s) // (s.kv_bytes_per_token * self.context_tokens)
                          for s in self.stages))

    @property
    def max_requests(self) -> int:
        return self.max_requests_per_replica * self.replicas

    @property
    def max_tokens_per_replica(self) -> int:
        """KV tokens the cache holds (one long request, or many short ones)."""
        return max(0, min(self._budget(s) // s.kv_bytes_per_token for s in self.stages))

    def used_at(self, batch: int) -> int:
        """Bytes the busiest rank uses with ``batch`` requests at full context (the reserve
        not counted)."""
        s = self.busiest
        kv = batch * self.context_tokens * s.kv_bytes_per_token
        return s.weights_bytes + s.activation_bytes + kv


def plan_memory(model: ModelSource, weights: Weights, layout: Layout, kv_dtype: str,
                compute_bytes: float, capacity_bytes: int, context: int,
                reserve: float = DEFAULT_RESERVE,
                step_tokens: int = DEFAULT_STEP_TOKENS) -> MemoryPlan:
    stages = stage_memory(model.shape, weights, layout, kv_dtype, compute_bytes, step_tokens)
    blocks = math.ceil(context / BLOCK_SIZE) * BLOCK_SIZE
    return MemoryPlan(capacity_bytes, reserve, stages, blocks, layout.replicas)
