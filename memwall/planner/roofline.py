"""How fast: decode and prefill on the roofline, with tensor- and pipeline-parallel costs.

A decode step of one pipeline stage, on one rank (B sequences in flight, B/PP in each stage
step, every sequence at context c):

    W_r    = W / (TP x PP)                           weights streamed (W: all weight bytes)
    KV_r   = (B / PP) x c x kv_r                     kv_r: KV bytes/token of the rank's heads
                                                     of the stage's layers (unsplit / TP / PP)
    t_mem  = (W_r + KV_r) / (BW x bandwidth_efficiency)
    t_cmp  = (B / PP) x (2 P_r + 4 c h D L / (TP x PP)) / (peak x compute_efficiency)
             P_r = matmul weights / (TP x PP): every layer's matrices and the LM head
    t      = max(t_mem, t_cmp) + 2 (L / PP) t_AR [TP > 1] + t_p2p [PP > 1] + t_host
    tokens/s = (B / PP) / t  per replica        tokens/s per sequence = 1 / (PP x t)

The ridge batch is where t_cmp = t_mem: B* = PP (W_r / BW) / ((2 P_r + attn) / F - c kv_r / BW),
none when the denominator is <= 0 (KV reads grow as fast as the math: long contexts stay
memory-bound at any batch). Arithmetic intensity = FLOPs / bytes of the step; the device's
ridge intensity is F / BW.

Worked example (the README's): Llama-3-70B, 70.55e9 params in bf16 (W = 141.1 GB), 8 x H100
(3.35 TB/s x 0.8 = 2.68 TB/s), t_AR = t_p2p = 12 us, B = 64, c = 2048.
    TP=8:        W_r 17.6 GB, kv_r 80 x 1 x 128 x 2 x 2 = 40 KiB, KV_r 64 x 2048 x 40 KiB =
                 5.37 GB; t = 22.99 GB / 2.68 TB/s + 2 x 80 x 12 us = 8.58 + 1.92 = 10.5 ms;
                 64 / t = 6,090 tok/s, 95 tok/s a sequence (B=1: 8.5 ms, 117)
    TP=4 x PP=2: W_r 17.6 GB, kv_r 40 x 2 x 128 x 4 = 40 KiB, KV_r 32 x 2048 x 40 KiB = 2.68 GB;
                 t = 7.58 + 2 x 40 x 12 us + 12 us = 8.55 ms; 32 / t = 3,740 tok/s,
                 1 / (2 t) = 58 tok/s a sequence (B=1: 66)

A calibrated CPU (memwall/planner/host.py) refines three terms with what calibrate.py measured
of memwall's own kernels and engine: W_r / BW becomes the time its B=1 kernels take to stream
the weights (a measured share of BW and a cost per output row, for each weight layout), t_host
is the engine's measured fixed cost of a step (scheduling, sampling, per-layer kernel launches;
0 for GPUs), and a prefill chunk's matmuls take the measured time of memwall's quantized matmul
per matrix (a cost per weight whatever the chunk's size, the weight dequantized for BLAS, and a
FLOP rate), attention its own measured rate.

W_r spreads the weights evenly, the embedding included (decode reads a row of it, so this
overcounts by its share: 1.5% for Llama-3-70B); the engine's stages differ from the even
split by at most a layer.

Prefill of a prompt of S tokens runs in chunks of n <= T (the step budget); a chunk at offset o:
    flops = n x 2 (P_r - V_r) + 2 V_r [last chunk]             V_r: the LM head's weights: a
                                                             chunk's logits are its last
                                                             token's only (the one sampled)
            + 4 h D (L / (TP x PP)) x (n o + n (n + 1) / 2)          (causal attention)
    bytes = W_r + (o + n) kv_r
    t_c   = max(bytes / BW, flops / F) + the same TP/PP communication + t_host (+ n x t_token)
    TTFT  = PP x sum(t_c)   one request passes the stages one after another (memwall fills the
                            pipeline with other requests' steps, not its own chunks)
    prefill tokens/s = S / sum(t_c) per replica (the stages busy with different requests)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from memwall.planner.layout import Layout

DEFAULT_COMM_US = 12.0  # one decode-sized NVLink all-reduce or stage-to-stage send



class ChunkMatmuls(Protocol):
    def seconds(self, n: int, last: bool) -> float:
        """The matmuls of a prefill chunk of ``n`` tokens (``last``: and the LM head's row)."""


@dataclass(frozen=True)
class StepModel:
    """Everything the formulas need, per rank of one replica."""

    weights_bytes: float
    """W_r."""
    kv_bytes_per_token: float
    """kv_r."""
    matmul_params: float
    """P_r."""
    attention_flops_per_key: float
    """4 h D L / (TP x PP): a decoded token's attention FLOPs per context token."""
    bandwidth: float
    """Achievable bytes/s."""
    flops: float
    """Achievable FLOP/s."""
    layout: Layout
    layers: int
    allreduce_s: float = DEFAULT_COMM_US * 1e-6
    p2p_s: float = DEFAULT_COMM_US * 1e-6
    head_params: float = 0.0
    """V_r: the LM head's matmul weights (part of P_r): a prefill chunk multiplies only its
    last token by them."""
    weight_read_s: float | None = None
    """Seconds a step takes to stream W_r through the kernels that read it (a calibrated CPU:
    each layout at its measured share of BW); None: W_r / bandwidth."""
    host_s: float = 0.0
    """t_host: the engine's fixed cost of a step beyond bytes and FLOPs (measured on a
    calibrated CPU; 0 elsewhere)."""
    host_token_s: float = 0.0
    """t_host's growth per token of a prefill chunk (the torch path's per-token work beyond
    matmuls and attention: norms, rotary, activations, KV writes)."""
    attention_flops: float | None = None
    """FLOP/s of prefill attention where measured apart from the matmuls; None: ``flops``."""
    masked_chunks: bool = False
    """A chunk after the first computes every query-key pair (memwall's CPU path gives SDPA an
    explicit mask, which it computes in full); False: the causal FLOPs."""
    chunk_matmuls: "ChunkMatmuls | None" = None
    """A prefill chunk's matmul seconds where measured per matrix (a calibrated CPU:
    memwall/planner/host.py, the per-weight cost t_chunk included); None: FLOPs / flops."""

    @property
    def weights_s(self) -> float:
        return self.weight_read_s if self.weight_read_s is not None else (
            self.weights_bytes / self.bandwidth)

    @property
    def comm_s(self) -> float:
        tp, pp = self.layout.tensor_parallel, self.layout.pipeline_parallel
        allreduce = 2 * (self.layers / pp) * self.allreduce_s if tp > 1 else 0.0
        return allreduce + (self.p2p_s if pp > 1 else 0.0)


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    context: int
    memory_s: float
    compute_s: float
    comm_s: float
    bytes: float
    flops: float
    pipeline: int
    replicas: int
    host_s: float = 0.0

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s + self.host_s

    @property
    def tokens_per_s(self) -> float:
        """All replicas together."""
        return self.batch / self.pipeline / self.step_s * self.replicas

    @property
    def tokens_per_s_per_sequence(self) -> float:
        return 1 / (self.pipeline * self.step_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes


def decode_step(m: StepModel, batch: int, context: int) -> DecodeStep:
    seqs = batch / m.layout.pipeline_parallel
    kv_bytes = seqs * context * m.kv_bytes_per_token
    flops = seqs * (2 * m.matmul_params + m.attention_flops_per_key * context)
    return DecodeStep(batch, context, m.weights_s + kv_bytes / m.bandwidth, flops / m.flops,
                      m.comm_s, m.weights_bytes + kv_bytes, flops, m.layout.pipeline_parallel,
                      m.layout.replicas, m.host_s)


def ridge_batch(m: StepModel, context: int) -> float | None:
    """The batch where compute time equals memory time; None if memory-bound at any batch."""
    per_seq = ((2 * m.matmul_params + m.attention_flops_per_key * context) / m.flops
               - context * m.kv_bytes_per_token / m.bandwidth)
    if per_seq <= 0:
        return None
    return m.layout.pipeline_parallel * m.weights_s / per_seq


@dataclass(frozen=True)
class Prefill:
    prompt_tokens: int
    stage_s: float
    """sum(t_c): one replica's stage time for the whole prompt."""
    pipeline: int
    replicas: int

    @property
    def ttft_s(self) -> float:
        return self.pipeline * self.stage_s

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.stage_s * self.replicas


def prefill(m: StepModel, prompt: int, step_tokens: int) -> Prefill:
    total, offset = 0.0, 0
    while offset < prompt:
        n = min(step_tokens, prompt - offset)
        total += prefill_chunk_s(m, n, offset, last=offset + n == prompt)
        offset += n
    return Prefill(prompt, total, m.layout.pipeline_parallel, m.layout.replicas)


def prefill_chunk_s(m: StepModel, n: int, offset: int, last: bool = True) -> float:
    """t_c of one chunk of ``n`` tokens after ``offset`` cached ones (module docstring)."""
    keys = n * (offset + n) if m.masked_chunks and offset else n * offset + n * (n + 1) / 2
    if m.chunk_matmuls is not None:
        matmul = m.chunk_matmuls.seconds(n, last)
    else:
        head = m.head_params if last else 0.0
        matmul = (n * 2 * (m.matmul_params - m.head_params) + 2 * head) / m.flops
    attention = m.attention_flops_per_key * keys / (m.attention_flops or m.flops)
    nbytes = m.weights_bytes + (offset + n) * m.kv_bytes_per_token
    return (max(nbytes / m.bandwidth, matmul + attention) + m.comm_s + m.host_s
            + n * m.host_token_s)


def batch_curve(m: StepModel, context: int, largest: int) -> list[DecodeStep]:
    """Decode steps at 1, 2, 4, ... up to ``largest`` (included)."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    sizes.append(max(1, largest))
    return [decode_step(m, size, context) for size in sizes]
