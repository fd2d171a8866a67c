"""Number formats the planner counts bytes in: weights (float, integer, GGUF block types) and
the KV cache's element types, each as the engine stores them.

    weights   bits per value          where the figure comes from
    fp32      32
    bf16      16
    fp16      16
    fp8       8                       e4m3, a float32 scale per output row (not counted)
    int8      8                       a scale per row or group (not counted)
    int4      4                       a scale and zero per group (not counted: +0.5-1 bit
                                      at groups of 32-64; a GGUF type says it exactly)
    Q4_0 4.5  Q4_1 5    Q5_0 5.5  Q5_1 6     Q8_0 8.5           (32-value blocks)
    Q2_K 2.625  Q3_K 3.4375  Q4_K 4.5  Q5_K 5.5  Q6_K 6.5625     (256-value super-blocks)
    IQ4_NL 4.5  IQ4_XS 4.25
        GGUF: block bytes x 8 / block values, gguf.GGML_QUANT_SIZES (scales included);
        tests/planner/test_precision.py holds this table to it.

    KV cache  bytes per token and KV head (head_dim D), as memwall/attention/kv_quant.py
    fp32 4 D    fp16 2 D    bf16 2 D    fp8 D    int8 D + 4 ceil(D / 16) (a float32 scale per 16)

No torch here: the engine's own figure (memwall.worker.kv_cache.bytes_per_token) is checked
against ``kv_bytes_per_token_head`` in the tests instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """A weight format: its canonical name and the bits one value costs."""

    name: str
    bits: float
    kind: str
    """float (fp32/bf16/fp16/fp8), int (int8/int4, weight-only) or gguf (a GGUF tensor type)."""

    @property
    def bytes_per_value(self) -> float:
        return self.bits / 8


_FLOATS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8}
_INTS = {"int8": 8, "int4": 4}
GGUF_BITS = {  # block bytes x 8 / block values (gguf.GGML_QUANT_SIZES)
    "F32": 32.0, "F16": 16.0, "BF16": 16.0,
    "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5,
    "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625,
    "IQ4_NL": 4.5, "IQ4_XS": 4.25,
}
PRECISIONS: dict[str, Precision] = {
    **{n: Precision(n, b, "float") for n, b in _FLOATS.items()},
    **{n: Precision(n, b, "int") for n, b in _INTS.items()},
    **{n: Precision(n, b, "gguf") for n, b in GGUF_BITS.items() if not n.startswith(("F", "BF"))},
}
# The engine's --dtype spellings (memwall/config.py EngineArgs.dtype) and GGUF's float names.
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "f32": "fp32",
           "f16": "fp16", "half": "fp16", "float": "fp32"}
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
"""What --dtype may name: the engine computes (and keeps float weights) in one of these."""
QUANTIZATIONS = ("auto", "none", "fp8", "int8", "int4", *(n.lower() for n in PRECISIONS
                                                          if PRECISIONS[n].kind == "gguf"))


def canonical(name: str) -> str:
    """``bfloat16`` -> ``bf16``, ``q4_k`` -> ``Q4_K``; unknown names come back unchanged."""
    low = name.strip().lower()
    low = ALIASES.get(low, low)
    return low if low in PRECISIONS else low.upper() if low.upper() in PRECISIONS else name


def precision(name: str) -> Precision:
    """The weight format called ``name`` (any spelling above); ValueError naming the choices."""
    found = PRECISIONS.get(canonical(name))
    if found is None:
        raise ValueError(f"unknown weight precision {name!r}; use one of "
                         f"{', '.join(PRECISIONS)}")
    return found


def compute_dtype(name: str, on_gpu: bool) -> str:
    """--dtype resolved as the engine does: ``auto`` is bf16 on a GPU and fp32 on the CPU."""
    if name == "auto":
        return "bf16" if on_gpu else "fp32"
    resolved = canonical(name)
    if resolved not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r} "
                         "(quantized weights: --quantization int8/int4/fp8/q4_k/...)")
    return resolved


# ---- KV cache ----------------------------------------------------------------------------------
KV_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
KV_SCALE_BYTES = {"int8": 4}
"""int8 stores a float32 scale per token, KV head and KV_SCALE_GROUP values (kv_quant.py)."""
KV_SCALE_GROUP = 16
KV_CACHE_DTYPES = ("auto", *KV_ELEMENT_BYTES)


def kv_cache_dtype(name: str, compute: str, on_gpu: bool) -> str:
    """--kv-cache-dtype resolved as memwall/worker/device.py does: ``auto`` is the compute
    dtype, except fp16 on the CPU with fp32 compute (kv_quant.CPU_AUTO)."""
    if name == "auto":
        return "fp16" if not on_gpu and compute == "fp32" else compute
    resolved = canonical(name)
    if resolved not in KV_ELEMENT_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{name!r}")
    return resolved


def kv_bytes_per_token_head(kv_dtype: str, head_dim: int) -> int:
    """One token's K (or V) of one KV head in the cache, int8's scales included."""
    groups = -(-head_dim // KV_SCALE_GROUP)
    return head_dim * KV_ELEMENT_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0) * groups


# ---- memwall's CPU kernel layouts --------------------------------------------------------------
CPU_LAYOUTS: dict[str, tuple[str, float]] = {
    "Q4_0": ("q4", 5), "Q4_1": ("q4", 5), "Q4_K": ("q4", 6),
    "Q5_0": ("q8", 9), "Q5_1": ("q8", 9), "Q8_0": ("q8", 9), "IQ4_NL": ("q8", 9),
    "Q5_K": ("q8", 10), "IQ4_XS": ("q8", 10), "Q6_K": ("q8", 12), "Q2_K": ("q8", 12),
    "Q3_K": ("q8", 12),
    "int4": ("q4", 6), "int8": ("q8", 9),
    "F32": ("f32", 32), "F16": ("f32", 32), "BF16": ("f32", 32), "fp32": ("f32", 32),
}
"""Weight format -> (the layout memwall's CPU kernels read it in, bits a weight takes there),
as memwall/quant/gguf_repack.py repacks GGUF blocks and memwall/quant quantizes float weights
(memwall/kernels/cpu/layout.py): q4 holds 4-bit codes and a scale and offset per 32 weights,
float16 where exact (Q4_0/Q4_1: 5 bits) else float32 (K-quants, our own int4: 6 bits); q8
holds int8 codes with float16 (9 bits: also our int8, whose bf16-rounded scales fp16 holds) or
float32 tables per 32 (10) or 16 (12) weights. Float GGUF tensors load in the compute dtype
(float32 on the CPU)."""


def cpu_layout(fmt: str) -> tuple[str, float]:
    """(layout, bits a weight) of a weight format on memwall's CPU engine: a GGUF type or the
    planner's int8/int4/fp32; other float formats (bf16, fp16, fp8) as float32, which is how
    the CPU engine computes them."""
    name = canonical(fmt)
    return CPU_LAYOUTS.get(name) or CPU_LAYOUTS.get(fmt) or ("f32", 32)
