"""How fast: decode and prefill on the roofline, with tensor- and pipeline-parallel costs.

A decode step of one pipeline stage, on one rank (B sequences in flight, B/PP in each stage
step, every sequence at context c):

    W_r    = W / (TP x PP)                           weights streamed (W: all weight bytes)
    KV_r   = (B / PP) x c x kv_r                     kv_r: KV bytes/token of the rank's heads
                                                     of the stage's layers (unsplit / TP / PP)
    t_mem  = (W_r + KV_r) / (BW x bandwidth_efficiency)
    t_cmp  = (B / PP) x (2 P_r + 4 c h D L / (TP x PP)) / (peak x compute_efficiency)
             P_r = matmul weights / (TP x PP): every layer's matrices and the LM head
    t      = max(t_mem, t_cmp) + 2 (L / PP) t_AR [TP > 1] + t_p2p [PP > 1]
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

W_r spreads the weights evenly, the embedding included (decode reads a row of it, so this
overcounts by its share: 1.5% for Llama-3-70B); the engine's stages differ from the even
split by at most a layer.

Prefill of a prompt of S tokens runs in chunks of n <= T (the step budget); a chunk at offset o:
    flops = n x 2 P_r + 4 h D (L / (TP x PP)) x (n o + n (n + 1) / 2)     (causal attention)
    bytes = W_r + (o + n) kv_r
    t_c   = max(bytes / BW, flops / F) + the same TP/PP communication
    TTFT  = PP x sum(t_c)   one request passes the stages one after another (memwall fills the
                            pipeline with other requests' steps, not its own chunks)
    prefill tokens/s = S / sum(t_c) per replica (the stages busy with different requests)
"""

from __future__ import annotations

from dataclasses import dataclass

from memwall.planner.layout import Layout

DEFAULT_COMM_US = 12.0  # one decode-sized NVLink all-reduce or stage-to-stage send



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

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

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
    nbytes = m.weights_bytes + seqs * context * m.kv_bytes_per_token
    flops = seqs * (2 * m.matmul_params + m.attention_flops_per_key * context)
    return DecodeStep(batch, context, nbytes / m.bandwidth, flops / m.flops, m.comm_s, nbytes,
                      flops, m.layout.pipeline_parallel, m.layout.replicas)


def ridge_batch(m: StepModel, context: int) -> float | None:
    """The batch where compute time equals memory time; None if memory-bound at any batch."""
    per_seq = ((2 * m.matmul_params + m.attention_flops_per_key * context) / m.flops
               - context * m.kv_bytes_per_token / m.bandwidth)
    if per_seq <= 0:
        return None
    return m.layout.pipeline_parallel * (m.weights_bytes / m.bandwidth) / per_seq


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
        keys = n * offset + n * (n + 1) / 2
        flops = n * 2 * m.matmul_params + m.attention_flops_per_key * keys
        nbytes = m.weights_bytes + (offset + n) * m.kv_bytes_per_token
        total += max(nbytes / m.bandwidth, flops / m.flops) + m.comm_s
        offset += n
    return Prefill(prompt, total, m.layout.pipeline_parallel, m.layout.replicas)


def batch_curve(m: StepModel, context: int, largest: int) -> list[DecodeStep]:
    """Decode steps at 1, 2, 4, ... up to ``largest`` (included)."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b *= 2
    sizes.append(max(1, largest))
    return [decode_step(m, size, context) for size in sizes]
