"""Raw GGUF blocks -> the layouts our CPU kernels read, without a float copy of the weight.

Two backends (``backend=`` "auto" picks native when memwall/kernels/cpu could be built):

native (fp32, exact): every weight is rebuilt as s * q + c with ggml's own fp32 arithmetic
    (B/weight: codes plus s and c tables as kept, memwall/kernels/cpu/layout.py: fp16 where
    that holds every value, ggml's two levels for the K-quants and IQ4_XS, a float32 d per 256
    values and an int8 sub-scale per group)
    Q4_0 / Q4_1         -> NativeQ4: 4-bit codes, s and c per 32 values      0.625 B/weight
    Q4_K                -> NativeQ4, two-level s and c per 32 values         0.59 B/weight
    Q5_0 / Q5_1         -> NativeQ8: int8 codes, s and c per 32 values       1.125 B/weight
    Q5_K                -> NativeQ8, two-level s and c per 32 values         1.09 B/weight
    Q8_0                -> NativeQ8 (as Q5_0)                                1.125 B/weight
    Q6_K                -> NativeQ8: int8 codes (q - 32), s per 16 values    1.16 B/weight
    Q2_K                -> NativeQ8: codes 0..3, s = d*sc, c = -dmin*mn      1.16 B/weight
                           per 16 values
    Q3_K                -> NativeQ8: codes -4..3, s = d*(sc - 32) per 16     1.16 B/weight
    IQ4_NL              -> NativeQ8: codes KVALUES_IQ4NL[q], s = d per 32    1.125 B/weight
                           (fp16 tables: s is d itself, c is 0)
    IQ4_XS              -> NativeQ8: codes KVALUES_IQ4NL[q], s = d*(ls-32)   1.09 B/weight
                           per 32
    Q5_0, Q8_0, Q6_K, Q3_K, IQ4_NL and IQ4_XS keep signed codes and an all-zero c, which the
    kernels do not read (QuantLinear.offsets_or_none): a decode step reads 1.0625 B/weight of
    Q5_0 / Q8_0 / IQ4_NL, 1.08 of Q6_K / Q3_K.
    Q2_K, Q3_K and IQ4 take 2.6, 3.4 and 4.25-4.5 bits a weight in the file, so kept as int8
    codes they grow 2-5x (still at most 3/8 of fp32), and stay exact.
    Exact because s * q is exact in fp32 for all four (at most 11 + 5 + 7 = 23 significant
    bits: an fp16 d, a 6-bit scale, a code up to 127), so the kernel's multiply-then-add
    rounds only where ggml's does, in Q2_K's subtraction of dmin*mn.

torch (torch's bf16 ops; int4 planes are  w = (code - 8) * scale + zero, group 32):
    type  ggml value                     int4 plane(s)                               exact?
    Q4_0  d * (q - 8)                    code q, scale d, zero 0                      yes*
    Q4_1  d * q + m                      code q, scale d, zero m + 8d                 yes*
    Q5_0  d * (q - 16), q = lo + 16 hi   plane lo: code lo, scale d, zero 8d;         yes*
                                         plane hi: code hi + 8, scale 16d, zero -16d
    Q5_1  d * q + m                      as Q5_0, plane lo's zero 8d + m, hi's 0      yes*
    Q4_K  d*sc[j] * q - dmin*mn[j]       code q, scale d*sc, zero 8*d*sc - dmin*mn    yes*
    Q5_K  as Q4_K with a 5th bit h       plane lo as Q4_K; plane hi: code h + 8,      yes*
                                         scale 16*d*sc, zero 0
    Q8_0  d * q, q in -128..127          plane hi: code (q >> 4) + 8, scale 16d,      yes*
                                         zero 0; plane lo: code q & 15, scale d, zero 8d
    Q6_K  d*sc[j] * (q - 32), j per 16   per-channel int8 (Int8WeightOnly)            no
    Q2_K  d*sc[j] * q - dmin*mn[j]       per-channel int8 (j per 16 values)           no
    Q3_K  d*(sc[j] - 32) * q, j per 16   per-channel int8                             no
    IQ4_NL d * KVALUES_IQ4NL[q]          per-channel int8                             no
    IQ4_XS d*(ls[j] - 32) * KVALUES[q]   per-channel int8 (j per 32 values)           no

    * up to bf16 rounding of scale and zero (relative 2^-9), because the op reads bf16;
      and the op also takes bf16 activations and rounds its output to bf16.
    Q6_K, Q2_K and Q3_K's 16-value groups are below the op's minimum group (32), and IQ4's
    levels are not evenly spaced, so those are dequantized and requantized per channel.

F32/F16/BF16 weights are not returned: they load as floats and stay nn.Linear.
GGUF's quantized blocks run along the input dimension, so permuting whole rows (llama's
q/k un-permutation) works on the raw bytes before any decoding.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from memwall.kernels.cpu.layout import two_level_table
from memwall.loader.gguf_loader import hf_tensor_name, unpermute_qk
from memwall.loader.gguf_weights import (QK_K, _bits, _f16, _k_scales_mins, _nibbles, dequantize,
                                         iq4_levels, iq4_xs_scales, q2_k_codes, q3_k_codes,
                                         q3_k_scales, q5_codes)
from memwall.quant.base import QuantWeights
from memwall.quant.int4_cpu import Int4WeightOnly, NativeQ4
from memwall.quant.int8_cpu import Int8WeightOnly, NativeQ8

# (codes [P, n_blocks, values], scale [P, n_blocks, groups], zero [same]) for one GGUF type
Planes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "lm_head")


# --------------------------------------------------------------------------- per-type planes

def _q4_0(b: torch.Tensor) -> Planes:
    d = _f16(b[:, :2])  # [n, 1]
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32)
    return q[None], d[None], torch.zeros_like(d)[None]


def _q4_1(b: torch.Tensor) -> Planes:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32)
    return q[None], d[None], (m + 8 * d)[None]


def _q5_planes(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Planes:
    """d * q + m for 5-bit codes q: the low 4 bits and the 5th as two int4 planes."""
    lo, hi = q & 15, (q >> 4) + 8
    return (torch.stack([lo, hi]), torch.stack([d, 16 * d]),
            torch.stack([8 * d + m, torch.zeros_like(d)]))


def _q5_0(b: torch.Tensor) -> Planes:
    d = _f16(b[:, :2])
    return _q5_planes(q5_codes(b[:, 2:6], b[:, 6:]), d, -16 * d)


def _q5_1(b: torch.Tensor) -> Planes:
    return _q5_planes(q5_codes(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _k_scale_zero(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K sub-block scale d*sc and zero 8*d*sc - dmin*mn: [n, 8] each."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl, ml = d * sc.float(), dmin * mn.float()
    return dl, 8 * dl - ml


def _q4_k(b: torch.Tensor) -> Planes:
    scale, zero = _k_scale_zero(b)
    q = _nibbles(b[:, 16:], 32).reshape(b.shape[0], QK_K)
    return q[None], scale[None], zero[None]


def _q5_k(b: torch.Tensor) -> Planes:
    n = b.shape[0]
    scale, zero = _k_scale_zero(b)
    lo = _nibbles(b[:, 48:], 32).reshape(n, QK_K)
    hi = _bits(b[:, 16:48], range(8), 0x01, 32).reshape(n, QK_K) + 8
    return (torch.stack([lo, hi]), torch.stack([scale, 16 * scale]),
            torch.stack([zero, torch.zeros_like(zero)]))


def _q8_0(b: torch.Tensor) -> Planes:
    d = _f16(b[:, :2])  # [n, 1]
    q = b[:, 2:].contiguous().view(torch.int8)  # [n, 32]
    hi, lo = (q >> 4) + 8, q & 15  # q = 16 * (hi - 8) + lo, both codes 0..15
    return (torch.stack([hi, lo]).to(torch.uint8), torch.stack([16 * d, d]),
            torch.stack([torch.zeros_like(d), 8 * d]))


_PLANES: dict[QType, Callable[[torch.Tensor], Planes]] = {
    QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1, QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k, QType.Q8_0: _q8_0,
}
# no exact int4-plane form (groups of 16, or IQ4's uneven levels): requantized to int8 rows
_REQUANTIZED = (QType.Q6_K, QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS)
REPACKABLE = (*_PLANES, *_REQUANTIZED)


# --------------------------------------------------------------------------- native (fp32) layouts

# (codes [n_blocks, block], s, c) with w = s * q + c, exactly ggml's arithmetic; codes fit 4
# bits for the Q4 types, int8 for the others. s and c are float [n_blocks, groups], or for the
# K-quants Factored: (d [n_blocks, 1] float32, sub [n_blocks, groups] integers) with entry
# d * sub, the product ggml forms, kept as two-level tables (memwall/kernels/cpu/layout.py).
Factored = tuple[torch.Tensor, torch.Tensor]
Codes = tuple[torch.Tensor, "torch.Tensor | Factored", "torch.Tensor | Factored"]


def _zeros(d: torch.Tensor, groups: int) -> Factored:
    return torch.zeros_like(d), torch.zeros(d.shape[0], groups, dtype=torch.int8)


# The 4-bit types return their codes packed in the kernels' q4 layout (per 32-value block,
# byte j = q[j] | q[j + 16] << 4): Q4_0 and Q4_1 store exactly that, and Q4_K's bytes move
# into it with four byte operations, never widened to a byte a value (the load's hot spot).

def _n_q4_0(b: torch.Tensor) -> Codes:
    d = _f16(b[:, :2])
    return b[:, 2:18], d, -8 * d


def _n_q4_1(b: torch.Tensor) -> Codes:
    return b[:, 4:20], _f16(b[:, :2]), _f16(b[:, 2:4])


def _q4_k_packed(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 code bytes a block -> the q4 layout. Chunk c's 32 bytes hold values 64c + j
    (low nibble of byte j) and 64c + 32 + j (high nibble): our block 2c takes the low nibbles
    of bytes j and j + 16, block 2c + 1 their high nibbles."""
    lo, hi = qs.reshape(-1, 4, 2, 16).unbind(2)  # [n, 4, 16]: bytes 0..15, 16..31 of a chunk
    first = (lo & 0x0F) | (hi << 4)  # uint8: the shift drops hi's high nibble
    second = (lo >> 4) | (hi & 0xF0)
    return torch.stack([first, second], dim=2).reshape(-1, 128)


_C_CODES_ON = True  # tests turn it off to compare the C codes with the torch ones


def _c_codes(name: str, b: torch.Tensor, per_block: int, dtype: torch.dtype,
             *args: int) -> torch.Tensor | None:
    """A block type's codes from gguf_codes.c (the same bytes as the torch operations beside
    each caller, at the speed of reading the file: those ran ~3 ns a byte), or None where the
    native kernels are not built (MEMWALL_NATIVE=0, no compiler). ``args`` go between the
    blocks' shape and the output (mw_gguf_k_scales: the scales' address; the output the mins)."""
    from memwall.kernels.cpu import build

    lib = build.lib() if _C_CODES_ON else None
    if lib is None:
        return None
    b = b.contiguous()
    out = torch.empty(b.shape[0], per_block, dtype=dtype)
    getattr(lib, name)(b.data_ptr(), b.shape[0], b.shape[1], *args, out.data_ptr())
    return out


def _n_q5_0(b: torch.Tensor) -> Codes:
    d = _f16(b[:, :2])
    q = _c_codes("mw_gguf_q5_codes", b, 32, torch.int8, 2, 6, 16)
    if q is None:
        q = q5_codes(b[:, 2:6], b[:, 6:]).view(torch.int8).sub_(16)
    return q, d, torch.zeros_like(d)


def _n_q5_1(b: torch.Tensor) -> Codes:
    q = _c_codes("mw_gguf_q5_codes", b, 32, torch.int8, 4, 8, 0)
    if q is None:
        q = q5_codes(b[:, 4:8], b[:, 8:]).view(torch.int8)
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _n_k_scales(b: torch.Tensor) -> tuple[Factored, Factored]:
    """Q4_K / Q5_K: s = d * sc, c = -dmin * mn (= -(dmin * mn) bit for bit), 8 per block."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc = torch.empty(b.shape[0], 8, dtype=torch.int8)
    mn = _c_codes("mw_gguf_k_scales", b, 8, torch.int8, sc.data_ptr())  # (scales, mins)
    if mn is None:
        sc, mn = (t.to(torch.int8) for t in _k_scales_mins(b[:, 4:16]))
    return (d, sc), (-dmin, mn)


def _n_q4_k(b: torch.Tensor) -> Codes:
    q = _c_codes("mw_gguf_q4_k_codes", b, 128, torch.uint8)
    return (q if q is not None else _q4_k_packed(b[:, 16:]), *_n_k_scales(b))


def _n_q5_k(b: torch.Tensor) -> Codes:
    n = b.shape[0]
    lo = _nibbles(b[:, 48:], 32).reshape(n, QK_K)
    hi = _bits(b[:, 16:48], range(8), 0x01, 32).reshape(n, QK_K)
    return (lo | (hi << 4)).to(torch.int8), *_n_k_scales(b)


def _n_q8_0(b: torch.Tensor) -> Codes:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8), d, torch.zeros_like(d)


def _n_q6_k(b: torch.Tensor) -> Codes:
    """Each 128-value half: ql's 64 bytes (a = bytes 0..31, b = 32..63) give the low 4 bits,
    qh's 32 bytes h the top 2: values j, 32 + j, 64 + j, 96 + j are a & 15 | (h & 3) << 4,
    b & 15 | (h >> 2 & 3) << 4, a >> 4 | (h >> 4 & 3) << 4, b >> 4 | (h >> 6) << 4, minus 32
    (ggml's dequantize_row_q6_K), in byte operations."""
    n = b.shape[0]
    q = _c_codes("mw_gguf_q6_k_codes", b, QK_K, torch.int8)
    if q is None:
        a, bb = b[:, 0:128].reshape(n, 2, 2, 32).unbind(2)  # [n, 2 halves, 32]
        h = b[:, 128:192].reshape(n, 2, 32)
        q = torch.stack([(a & 0x0F) | ((h & 0x03) << 4), (bb & 0x0F) | ((h & 0x0C) << 2),
                         (a >> 4) | (h & 0x30), (bb >> 4) | ((h >> 2) & 0x30)], dim=2)
        q = (q.view(torch.int8) - 32).reshape(n, QK_K)
    d = _f16(b[:, 208:210])
    return q, (d, b[:, 192:208].contiguous().view(torch.int8)), _zeros(d, 16)  # 16 per block


def _n_q2_k(b: torch.Tensor) -> Codes:
    # s * q is exact (d*sc has at most 15 bits, q 2), so s * q + c rounds as d*sc * q - dmin*mn
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    sc = b[:, 0:16]
    codes = q2_k_codes(b[:, 16:80]).reshape(b.shape[0], QK_K).to(torch.int8)
    return codes, (d, (sc & 0x0F).to(torch.int8)), (-dmin, (sc >> 4).to(torch.int8))


def _n_q3_k(b: torch.Tensor) -> Codes:
    d = _f16(b[:, 108:110])
    return q3_k_codes(b).reshape(b.shape[0], QK_K), (d, q3_k_scales(b[:, 96:108])), _zeros(d, 16)


def _n_iq4_nl(b: torch.Tensor) -> Codes:
    d = _f16(b[:, :2])  # [n, 1]
    return iq4_levels(b[:, 2:]).reshape(b.shape[0], 32), d, torch.zeros_like(d)


def _n_iq4_xs(b: torch.Tensor) -> Codes:
    d = _f16(b[:, :2])
    return iq4_levels(b[:, 8:]).reshape(b.shape[0], QK_K), (d, iq4_xs_scales(b)), _zeros(d, 8)


_NATIVE: dict[QType, Callable[[torch.Tensor], Codes]] = {
    QType.Q4_0: _n_q4_0, QType.Q4_1: _n_q4_1, QType.Q5_0: _n_q5_0, QType.Q5_1: _n_q5_1,
    QType.Q4_K: _n_q4_k, QType.Q5_K: _n_q5_k, QType.Q8_0: _n_q8_0, QType.Q6_K: _n_q6_k,
    QType.Q2_K: _n_q2_k, QType.Q3_K: _n_q3_k, QType.IQ4_NL: _n_iq4_nl, QType.IQ4_XS: _n_iq4_xs,
}
_NATIVE_4BIT = (QType.Q4_0, QType.Q4_1, QType.Q4_K)


def _row_table(t: "torch.Tensor | Factored", n: int) -> torch.Tensor:
    """One of ``Codes``' s or c for a weight of n rows: float [n, groups], or the two-level
    table [n, superblocks, 4 + groups a superblock] of a Factored one."""
    if isinstance(t, tuple):
        d, sub = t
        return two_level_table(d.reshape(n, -1), sub.reshape(n, -1))
    return t.reshape(n, -1)


def _repack_native(blocks: torch.Tensor, qtype: QType, n: int, k: int) -> QuantWeights:
    q, s, c = _NATIVE[qtype](blocks)
    s, c = _row_table(s, n), _row_table(c, n)
    if qtype in _NATIVE_4BIT:  # already packed: two codes a byte
        return NativeQ4().from_packed(q.reshape(n, k // 2), s, c, source=f"gguf {qtype.name}")
    return NativeQ8().from_codes(q.reshape(n, k), s, c, source=f"gguf {qtype.name}")


# --------------------------------------------------------------------------- one tensor

def repack(raw: torch.Tensor | np.ndarray, qtype: QType, shape: tuple[int, int],
           backend: str = "auto") -> QuantWeights | None:
    """Raw GGUF bytes of one Linear weight -> QuantWeights; None for float types.

    raw: uint8 [rows, row_bytes] (``tensor.data`` of GGUFReader) or any view of those bytes;
    shape: (out_features, in_features) in numpy order. backend "native" (our fp32 kernels,
    exact), "torch" (torch's bf16 int4/int8 ops) or "auto" (native when it could be built).
    """
    qtype = QType(qtype)
    if qtype not in REPACKABLE:
        return None
    n, k = shape
    raw_t = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw_t.reshape(-1, type_size)
    if blocks.shape[0] * block != n * k:
        raise ValueError(f"GGUF {qtype.name} weight {shape}: {blocks.shape[0]} blocks do not "
                         f"hold {n * k} values")
    if use_native(backend):
        return _repack_native(blocks, qtype, n, k)
    if qtype in _REQUANTIZED:
        w = dequantize(raw_t.numpy(), qtype, shape)
        return Int8WeightOnly().create_weights(w, source=f"gguf {qtype.name} -> int8 per-channel")
    q, scale, zero = _PLANES[qtype](blocks)  # [P, n_blocks, block], [P, n_blocks, groups]
    planes = q.shape[0]
    method = Int4WeightOnly(group_size=32)
    return method.from_planes(q.reshape(planes, n, k), scale.reshape(planes, n, k // 32),
                              zero.reshape(planes, n, k // 32), source=f"gguf {qtype.name}")


def use_native(backend: str) -> bool:
    """Resolve a backend name: "native", "torch" or "auto"."""
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"quantization backend {backend!r}: use 'auto', 'native' or 'torch'")
    if backend == "torch":
        return False
    from memwall.kernels.cpu.build import available
    if backend == "native" and not available():
        raise RuntimeError("memwall's native quantized kernels are not available (no C compiler, "
                           "or MEMWALL_NATIVE=0); use backend 'torch' or 'auto'")
    return available()


# --------------------------------------------------------------------------- a whole file

def down_proj_unit(reader: Any, keep_quantized: bool) -> int:
    """Where a tensor-parallel cut of the down projections' inputs may fall so that each rank
    reads whole blocks from the file: the least common multiple of their block sizes (1 for
    float weights, or when everything is dequantized)."""
    unit = 1
    for t in reader.tensors:
        if keep_quantized and t.name.endswith("ffn_down.weight") and QType(t.tensor_type) in REPACKABLE:
            unit = math.lcm(unit, GGML_QUANT_SIZES[QType(t.tensor_type)][0])
    return unit


def gguf_quantized_linears(reader: Any, config: dict[str, Any], include_lm_head: bool = True,
                           backend: str = "auto", include_embedding: bool = True,
                           wanted: Any = None, slice_of: Any = None,
                           requantize: QType | None = None) -> dict[str, QuantWeights]:
    """``{module name: QuantWeights}`` for every quantized Linear weight of a GGUF file, and
    for the token embedding when ``include_embedding`` and a ``QuantEmbedding`` can hold it.

    ``config`` is ``gguf_hf_config(reader)``. Names are HF module paths such as
    ``model.layers.0.self_attn.q_proj``; a tied file's ``token_embd.weight`` becomes ``lm_head``
    and, the same object, ``model.embed_tokens`` (one copy of the table serves both). Float-typed
    weights are left out: they load as floats and stay ``nn.Linear``/``nn.Embedding``. q/k rows
    are un-permuted for llama/mistral, as ``iter_gguf_tensors`` does for the float path.
    ``backend``: see ``repack``. Tensors are read and repacked one at a time, so the peak is
    the result plus one tensor's transients. ``wanted(hf_name)`` False: the tensor is not read
    (another pipeline stage's layer). ``slice_of(hf_name)``: the ``TensorSlice`` a
    tensor-parallel rank holds (memwall/loader/slicing.py); only its rows, and its columns'
    blocks where the cut falls on the file's blocks, are read (else whole rows are read and
    repacked, then cut on the repacked layout's scale groups).
    ``requantize`` (Q4_0 or Q4_1; tensors read whole, not with ``slice_of``): the weights whose
    native layout keeps a byte a code (Q5_0, Q8_0, Q6_K...) are decoded and rounded to that
    4-bit type first (``requantize_to_q4``). Lossy: for a drafter, whose tokens the target
    verifies.
    """
    from memwall.quant.embedding import QuantEmbedding
    from memwall.quant.transform import EMBEDDING

    tied = bool(config.get("tie_word_embeddings"))
    out: dict[str, QuantWeights] = {}
    for t in reader.tensors:
        module = _quantized_module(t.name, tied, include_lm_head, include_embedding)
        if module is None or QType(t.tensor_type) not in REPACKABLE:
            continue
        if wanted is not None and not wanted(hf_tensor_name(t.name)):
            continue
        part = slice_of(hf_tensor_name(t.name)) if slice_of is not None else None
        if part is None:
            raw, qtype = _raw_rows(t, module, config), QType(t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if requantize is not None and qtype not in _NATIVE_4BIT:
                raw, qtype = requantize_to_q4(raw, qtype, shape, requantize)
            weights = repack(raw, qtype, shape, backend)
        else:
            weights = _repack_slice(t, module, config, part, backend)
        if module == EMBEDDING and not QuantEmbedding.supports(weights):
            continue  # stays a float nn.Embedding
        out[module] = weights
        if module == "lm_head" and tied and include_embedding and QuantEmbedding.supports(weights):
            out[EMBEDDING] = weights
    return out


REQUANTIZE_TYPES = {"q4_0": QType.Q4_0, "q4_1": QType.Q4_1}
"""``requantize`` choices (a drafter's spec config key): name -> the 4-bit GGUF type."""


def requantize_to_q4(raw: torch.Tensor, qtype: QType, shape: tuple[int, int],
                     target: QType = QType.Q4_1) -> tuple[torch.Tensor, QType]:
    """Raw blocks of a weight kept a byte a code in memory (Q5_0, Q8_0, Q6_K...: NativeQ8,
    1.06-1.16 bytes a weight) -> raw ``target`` (Q4_1: 4-bit codes, a scale and a minimum per
    32 values, 0.625 bytes a weight as NativeQ4) blocks of the decoded values, by gguf's own
    quantizer. A drafter of Qwen2.5-Coder-0.5B (Q5_0 / Q8_0 / Q6_K) reads 293 MiB a token instead
    of 505 and decodes in 14.4 ms instead of 20.2 here; its drafts were accepted as often
    (90%) by the 1.5B target (README, session 24)."""
    if target not in REQUANTIZE_TYPES.values():
        raise ValueError(f"requantizing to {target.name} is not supported (Q4_0, Q4_1)")
    from gguf import quants

    values = dequantize(np.ascontiguousarray(raw.numpy()), qtype, shape).numpy().reshape(shape)
    blocks = quants.quantize(np.ascontiguousarray(values, dtype=np.float32), target)
    return torch.from_numpy(np.ascontiguousarray(blocks)), target


def _quantized_module(gguf_name: str, tied: bool, include_lm_head: bool,
                      include_embedding: bool) -> str | None:
    """The module a GGUF weight becomes when kept quantized; None when it is not one of those."""
    name = hf_tensor_name(gguf_name)
    if name == "model.embed_tokens.weight":
        if tied:
            return "lm_head" if include_lm_head else None
        return "model.embed_tokens" if include_embedding else None
    if name is None or not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    leaf = module.rsplit(".", 1)[-1]
    if leaf not in LINEAR_MODULES or (leaf == "lm_head" and not include_lm_head):
        return None
    return module


def _repack_slice(t: Any, module: str, config: dict[str, Any], part: Any,
                  backend: str) -> QuantWeights:
    """One tensor-parallel rank's slice of a quantized weight, reading only its rows (and its
    columns' blocks when the cut falls on them and repacking them alone changes nothing)."""
    from memwall.loader.gguf_loader import read_tensor_rows
    qtype = QType(t.tensor_type)
    rows_total, cols_total = (int(d) for d in reversed(t.shape.tolist()))
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = _file_rows(part.row_index(rows_total), module, config, rows_total)
    cols = part.cols or (0, cols_total)
    # torch's requantized types take a scale per row over the whole row: cut those after
    raw_cut = cols[0] % block == 0 and cols[1] % block == 0 and (
        qtype not in _REQUANTIZED or use_native(backend))
    if raw_cut:
        raw = read_tensor_rows(t, rows, (cols[0] // block * type_size, cols[1] // block * type_size))
        return repack(torch.from_numpy(raw), qtype, (len(rows), cols[1] - cols[0]), backend)
    whole = repack(torch.from_numpy(read_tensor_rows(t, rows)), qtype, (len(rows), cols_total), backend)
    from memwall.quant.base import QuantLinear
    layer = QuantLinear(whole)
    unit = whole.method.column_unit(layer)
    cut = whole.method.take_columns(layer, *cols) if unit and cols[0] % unit == 0 == cols[1] % unit else None
    if cut is None:
        raise ValueError(f"{t.name}: inputs {cols[0]}..{cols[1]} cannot be cut from a "
                         f"{qtype.name} weight held as {whole.source}")
    return cut


def _file_rows(rows: np.ndarray, module: str, config: dict[str, Any], total: int) -> np.ndarray:
    """The file's row of each wanted row in HF order (llama/mistral files permute q/k rows)."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    leaf = module.rsplit(".", 1)[-1]
    if config.get("model_type") in ("llama", "mistral") and leaf in heads:
        order = unpermute_qk(torch.arange(total), heads[leaf]).numpy()  # HF row -> file row
        return order[rows]
    return rows


def _raw_rows(t: Any, module: str, config: dict[str, Any]) -> torch.Tensor:
    """uint8 [rows, row_bytes] of one tensor, q/k rows un-permuted for llama/mistral files."""
    data = t.data  # a fresh array (gguf_file.py); a numpy view of an mmap (gguf.GGUFReader)
    if not data.flags.writeable or not data.flags.c_contiguous:
        data = np.array(data)
    raw = torch.from_numpy(data.view(np.uint8).reshape(int(t.shape[-1]), -1))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    leaf = module.rsplit(".", 1)[-1]
    if config.get("model_type") in ("llama", "mistral") and leaf in heads:
        raw = unpermute_qk(raw, heads[leaf]).contiguous()
    return raw
