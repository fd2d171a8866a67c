"""This machine's engine in the roofline: what a calibration measured of memwall's CPU kernels
and engine (hardware.HostRates, written by calibrate.py) turned into roofline terms and a peak
resident size, from the model's matrices as the CPU engine holds them.

    matrices        what a step multiplies by, as the engine fuses them: per layer qkv
                    [(h + 2g) D, H], o [H, h D], gate_up [2 I, H], down [H, I]; the LM head
                    [V, H]; each in memwall's CPU layout (precision.cpu_layout: GGUF Q4_1 -> q4
                    at 5 bits a weight, Q8_0 -> q8 at 9, float -> f32 at 32)
    decode weights  sum over matrices of N x decode_row_s[layout]
                                         + bytes / (BW x decode_bandwidth_share[layout])
                    (memwall's B=1 kernels pay a cost per output row besides their streaming:
                    a short row, as the LM head's 576 weights of SmolLM2, streams slower)
    t_host decode   decode_step + L x decode_layer
    prefill chunk   n tokens through each layer matrix of P weights: P x weight_s + 2 n P / F,
                    (weight_s, F) of the matrix's layout and size class: up to LARGE_WEIGHTS
                    weights, or more (a float32 copy over 32 MiB: glibc's largest mmap
                    threshold, above which every copy comes from fresh kernel pages); a chunk of
                    at most 128 tokens runs the integer kernels instead (no copy, matmul_flops
                    int8_prefill); the LM head as a decode step's, for the last token only
    t_host prefill  prefill_step + L x (prefill_layer + n (H + I) prefill_value_layer): the
                    torch path's elementwise work (norms, rotary, activation, residuals) grows
                    with the tokens and the layer's width

Peak resident size of one engine process (``resident``), what benchmarks/memory.py reads as
VmHWM:
    runtime         runtime_rss_bytes: Python, torch and memwall with a tiny model
    weights         every weight in its CPU layout (the GGUF's pages are released after load)
    KV              the blocks a request's tokens fill, in whole huge pages per layer tensor
                    where the kernel backs numpy's large arrays with them (the cache is
                    calloc'ed: untouched blocks cost nothing)
    step            the largest prefill step's temporaries: its hidden states
                    (memory.activation_bytes without the sampled rows' logits, which a prefill
                    does not have) and the copy a chunk of more than 128 tokens makes of the
                    largest matrix (prefill_copy_bytes a weight: float32 for BLAS on CPUs
                    without memwall's fp32 tiles)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memwall.planner.hardware import Device, HostRates
from memwall.planner.precision import cpu_layout
from memwall.planner.shapes import ModelShape
from memwall.planner.sources import ModelSource

NUMPY_HUGE_PAGE_MIN = 4 << 20  # numpy madvises arrays of at least 4 MiB for huge pages
INT_ACTS_MAX_TOKENS = 256  # kernels/cpu/quant_ops.py: chunks up to this run the integer kernels
# (kernels/cpu/int8_tiles.c also takes larger chunks of K-quant, Q5_0/Q5_1 and, when asked,
# Q4_0/Q4_1 weights on AVX2, with no BLAS copy; the calibration does not measure it yet, so
# predictions for those formats above this size are pessimistic in time and in the copy's memory)
LARGE_WEIGHTS = 8 << 20  # weights whose float32 copy exceeds 32 MiB (glibc's mmap threshold cap)


@dataclass(frozen=True)
class Matrix:
    """``count`` matrices [rows, cols] in one CPU layout."""

    layout: str
    rows: int
    cols: int
    count: int
    bits: float

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count

    @property
    def bytes(self) -> float:
        return self.params * self.bits / 8

    @property
    def large(self) -> bool:
        return self.rows * self.cols > LARGE_WEIGHTS


@dataclass(frozen=True)
class CpuWeights:
    """A model's weights as memwall's CPU engine holds them."""

    layers: tuple[Matrix, ...]
    """Every layer's fused projections (count: the layers)."""
    head: Matrix
    resident_bytes: float
    """All weights (the embedding and norms too)."""

    @property
    def matrices(self) -> tuple[Matrix, ...]:
        return (*self.layers, self.head)


def cpu_weights(model: ModelSource, quantization: str) -> CpuWeights:
    """``quantization`` as plan.py resolves it: auto (a GGUF's own types), none, or a format."""
    shape, gguf = model.shape, model.gguf
    if quantization == "auto" and gguf is not None and gguf.layer_matrix_params:
        layout, bits = _mixed(gguf.layer_matrix_params)
        head_layout, head_bits = cpu_layout(gguf.head_type or "F32")
        resident = sum(n * cpu_layout(t)[1] / 8 for t, n in gguf.params.items())
        return CpuWeights(_layer_matrices(shape, layout, bits),
                          Matrix(head_layout, shape.vocab, shape.hidden, 1, head_bits), resident)
    fmt = "fp32" if quantization in ("auto", "none") else quantization
    layout, bits = cpu_layout(fmt)
    layers = _layer_matrices(shape, layout, bits)
    head = Matrix(layout, shape.vocab, shape.hidden, 1, bits)
    # float: the embedding (and the head unless tied) in float32; quantized: the float
    # embedding stays for lookups and the head is quantized (a tied head as a copy)
    floats = shape.layers * shape.layer_vector_params() + shape.hidden + shape.embedding_params()
    shared = shape.tied_embeddings and fmt == "fp32"
    resident = sum(m.bytes for m in layers) + floats * 4 + (0 if shared else head.bytes)
    return CpuWeights(layers, head, resident)


def _mixed(params: dict[str, int]) -> tuple[str, float]:
    """One layout for layers of several GGUF types (a K-quant mix): the most common one's,
    at the weighted mean bits."""
    total = sum(params.values())
    main = max(params, key=params.get)
    bits = sum(n * cpu_layout(t)[1] for t, n in params.items()) / total
    return cpu_layout(main)[0], bits


def _layer_matrices(shape: ModelShape, layout: str, bits: float) -> tuple[Matrix, ...]:
    h, d, L = shape.hidden, shape.head_dim, shape.layers
    return (Matrix(layout, (shape.heads + 2 * shape.kv_heads) * d, h, L, bits),
            Matrix(layout, h, shape.heads * d, L, bits),
            Matrix(layout, 2 * shape.intermediate, h, L, bits),
            Matrix(layout, h, shape.intermediate, L, bits))


@dataclass(frozen=True)
class HostTerms:
    """The StepModel fields a calibrated CPU sets (roofline.py), for one rank of ``ranks``."""

    weight_read_s: float | None
    decode_host_s: float
    prefill_host_s: float
    prefill_token_s: float
    attention_flops: float | None
    prefill_matmul_s: "PrefillMatmuls | None"


@dataclass(frozen=True)
class PrefillMatmuls:
    """A prefill chunk's matmul time: fixed + n x per_token (above INT_ACTS_MAX_TOKENS), or
    n x small_per_token (the integer kernels, at most INT_ACTS_MAX_TOKENS tokens), plus
    head_s for the LM head's one row."""

    fixed_s: float
    per_token_s: float
    small_per_token_s: float
    head_s: float

    def seconds(self, n: int, last: bool) -> float:
        head = self.head_s if last else 0.0
        if n <= INT_ACTS_MAX_TOKENS:
            return n * self.small_per_token_s + head
        return self.fixed_s + n * self.per_token_s + head


def host_terms(device: Device, weights: CpuWeights, shape: ModelShape, layers: int,
               ranks: int) -> HostTerms | None:
    """None where the device has no HostRates (a GPU, or an older calibration file).
    ``layers``: a pipeline stage's."""
    rates, bandwidth = device.host, device.achievable_bandwidth
    if rates is None or bandwidth is None:
        return None
    read_s = None
    if rates.decode_share:
        read_s = sum(_gemv_s(m, rates, bandwidth) for m in weights.matrices) / ranks
    h = rates.host
    return HostTerms(read_s, h.get("decode_step", 0.0) + layers * h.get("decode_layer", 0.0),
                     h.get("prefill_step", 0.0) + layers * h.get("prefill_layer", 0.0),
                     layers * (shape.hidden + shape.intermediate) * h.get("prefill_value_layer", 0.0),
                     rates.attention_flops,
                     _prefill_matmuls(device, weights, ranks))


def _gemv_s(m: Matrix, rates: HostRates, bandwidth: float) -> float:
    """One token through ``m`` on memwall's B=1 kernels (module docstring)."""
    share = _figure(rates.decode_share, m.layout, min) or 1.0
    row_s = _figure(rates.decode_row_s, m.layout, max) or 0.0
    return m.rows * m.count * row_s + m.bytes / (bandwidth * share)


def _prefill_matmuls(device: Device, weights: CpuWeights, ranks: int) -> PrefillMatmuls | None:
    rates = device.host
    if not rates.prefill_flops:
        return None
    fixed = per_token = 0.0
    for m in weights.layers:
        key = m.layout + ("_large" if m.large else "")
        if m.layout == "f32" and device.peak_flops.get("fp32"):  # float weights: plain BLAS
            per_token += 2 * m.params / device.peak_flops["fp32"]
            continue
        fixed += m.params * (_figure(rates.prefill_weight_s, key, max) or 0.0)
        per_token += 2 * m.params / _figure(rates.prefill_flops, key, min)
    small = (device.peak_flops.get("int8_prefill") or device.peak_flops.get("int8_decode")
             or _figure(rates.prefill_flops, "q4", min))
    small_per_token = sum(2 * m.params for m in weights.layers) / small
    head = _gemv_s(weights.head, rates, device.achievable_bandwidth) if rates.decode_share else (
        2 * weights.head.params / small)
    return PrefillMatmuls(fixed / ranks, per_token / ranks, small_per_token / ranks, head / ranks)


def _figure(table: dict[str, float], key: str, worst) -> float | None:
    """A measured figure: ``key`` (q4_large), else its layout's (q4), else the least favourable
    one the table holds (``worst``: min of rates, max of costs); None for an empty table."""
    for k in (key, key.removesuffix("_large")):
        if k in table:
            return table[k]
    return worst(table.values()) if table else None


@dataclass(frozen=True)
class Resident:
    """Peak resident bytes of one engine process (module docstring), by part."""

    runtime: int
    weights: int
    kv: int
    step: int

    @property
    def total(self) -> int:
        return self.runtime + self.weights + self.kv + self.step


def resident(rates: HostRates, shape: ModelShape, weights: CpuWeights, kv_per_token_head: int,
             cache_tokens: int, used_tokens: int, chunk_tokens: int, block_size: int) -> Resident:
    """Peak RSS of an engine with a KV cache of ``cache_tokens`` tokens serving requests that
    fill ``used_tokens`` of it, prefilling ``chunk_tokens`` a step."""
    tensor = cache_tokens * shape.kv_heads * kv_per_token_head  # one layer's K (or V)
    used = math.ceil(used_tokens / block_size) * block_size * shape.kv_heads * kv_per_token_head
    page = rates.huge_page_bytes
    if page and tensor >= NUMPY_HUGE_PAGE_MIN:
        used = min(tensor, math.ceil(used / page) * page)
    copy = rates.prefill_copy_bytes if chunk_tokens > INT_ACTS_MAX_TOKENS else 0
    largest = max((m.rows * m.cols for m in weights.layers if m.layout != "f32"), default=0)
    return Resident(rates.runtime_bytes or 0, round(weights.resident_bytes), 2 * shape.layers * used,
                    step_bytes(shape, chunk_tokens) + largest * copy)


def step_bytes(shape: ModelShape, tokens: int) -> int:
    """A prefill step's hidden states: ``tokens`` tokens in float32 (memory.activation_bytes
    without logits: a prefill samples one row)."""
    h, d = shape.hidden, shape.head_dim
    attention = 2 * h + (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d
    mlp = 2 * h + 3 * shape.intermediate
    return round(tokens * 4 * max(attention, mlp))
