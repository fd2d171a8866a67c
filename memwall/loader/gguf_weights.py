"""Dequantization of GGUF tensors into float32 torch tensors.

Every kernel works on the whole tensor at once: the raw bytes are viewed as a
``[n_blocks, type_size]`` uint8 matrix, the fields of each block are sliced out as
columns, and the values are rebuilt with broadcasting. There is no Python loop over
blocks, so a 50k x 576 embedding dequantizes in milliseconds.

The block layouts follow ggml (ggml-common.h / ggml-quants.c). The arithmetic is done in
the same order as gguf-py's numpy reference (``gguf.quants``), so results are bit-identical
to it, which is what transformers uses when it loads a GGUF file.

``QK_K`` = 256 is the super-block size of the K-quants (and IQ4_XS); the legacy quants and
IQ4_NL use 32.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from memwall.loader.errors import ModelLoadError

QK_K = 256

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                        "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

# IQ4_NL/IQ4_XS's 16 non-uniform levels (ggml-common.h kvalues_iq4nl): a 4-bit code indexes this
KVALUES_IQ4NL = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                             dtype=torch.int8)


# --------------------------------------------------------------------------- helpers

def _f16(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian uint8 bytes -> [n, 1] float32 (an fp16 scale field)."""
    return cols.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split packed 4-bit values: [n, k*group] bytes -> [n, k, 2, group] (low nibble first).

    ggml stores the low nibbles of ``group`` consecutive bytes as one run of values and the
    high nibbles of the same bytes as the next run, not interleaved per byte.
    """
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(qh: torch.Tensor, shifts: range, mask: int, group: int) -> torch.Tensor:
    """[n, k*group] bytes -> [n, k, len(shifts), group]: field ``(byte >> s) & mask`` per shift."""
    q = qh.reshape(qh.shape[0], -1, 1, group)
    s = torch.tensor(list(shifts), dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (q >> s) & mask


# --------------------------------------------------------------------------- legacy quants (32 values a block)

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """Q8_0, 34 bytes:  | d f16 (2) | qs int8 x32 |   value = q * d"""
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """Q4_0, 18 bytes:  | d f16 (2) | qs 16 bytes: value j = low nibble of byte j, value j+16 = high |

    value = d * (q - 8)
    """
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """Q4_1, 20 bytes:  | d f16 | m f16 | qs 16 bytes (as Q4_0) |   value = d * q + m"""
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return d * q + m


# byte b -> 8 bytes, byte j holding bit j of b at bit 4: one gather spreads a qh byte over the
# fifth bits of its 8 values (little-endian: byte j of the word is value 8w + j)
_SPREAD_BITS = torch.tensor([sum(((b >> j) & 1) << (8 * j + 4) for j in range(8)) for b in range(256)],
                            dtype=torch.int64)
_Q5_CHUNK = 16384  # blocks a pass: the temporaries stay in cache


def q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit codes 0..31 [n, 32] uint8: the low 4 bits as Q4_0's nibbles, bit 4 of
    value j is bit j of the little-endian 32-bit qh. (A table spreads each qh byte, in chunks
    written into the result: 0.2 s for the 136M values of Qwen2.5-Coder-0.5B's embedding where
    byte-wise bit fields took 0.7 s. Loading with the native kernels built takes
    gguf_codes.c's loop instead; this stays the reference and the fallback.)"""
    n = qs.shape[0]
    out = torch.empty(n, 32, dtype=torch.uint8)
    for a in range(0, n, _Q5_CHUNK):
        b = min(n, a + _Q5_CHUNK)
        q, o = qs[a:b], out[a:b]
        torch.bitwise_and(q, 0x0F, out=o[:, :16])
        torch.bitwise_right_shift(q, 4, out=o[:, 16:])
        o.bitwise_or_(_SPREAD_BITS[qh[a:b].long()].view(torch.uint8).reshape(b - a, 32))
    return out


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """Q5_0, 22 bytes:  | d f16 | qh 4 bytes (bit j: bit 4 of value j) | qs 16 (as Q4_0) |

    value = d * (q - 16)
    """
    d = _f16(b[:, :2])
    return d * (q5_codes(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """Q5_1, 24 bytes:  | d f16 | m f16 | qh 4 | qs 16 |   value = d * q + m"""
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * q5_codes(b[:, 4:8], b[:, 8:]).float() + m


# --------------------------------------------------------------------------- K-quants (256 values a super-block)

def q2_k_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit fields [n, 64] bytes -> [n, 16, 16] (16-value groups), codes 0..3.

    Each 32-byte half holds 128 values: bits 2t..2t+1 of byte i are value 32t + i of the half.
    """
    return _bits(qs, range(0, 8, 2), 0x03, 32).reshape(qs.shape[0], 16, 16)


def q3_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q3_K's signed 3-bit codes -4..3 [n, 16, 16]: the 2 low bits as Q2_K's, and bit j of
    hmask[i] for value 32j + i, which when CLEAR subtracts 4 (ggml stores the bit inverted)."""
    hi = _bits(b[:, 0:32], range(8), 0x01, 32).reshape(b.shape[0], 16, 16)
    return q2_k_codes(b[:, 32:96]).to(torch.int8) - ((hi ^ 1) << 2).to(torch.int8)


def q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12-byte scale field -> 16 six-bit scales minus 32, int8 [n, 16] (-32..31).

    byte:  0..7                  8..11     (A..P = scales 0..15)
           IIIIAAAA .. PPPPHHHH  MMIIEEAA .. PPLLHHDD
    Scale j takes its low 4 bits from the low (j < 8) or high (j >= 8) nibble of byte j % 8,
    and its top 2 bits from bits 2(j // 4).. of byte 8 + j % 4.
    """
    lo = _nibbles(s[:, 0:8], 8).reshape(s.shape[0], 16)
    hi = _bits(s[:, 8:12], range(0, 8, 2), 0x03, 4).reshape(s.shape[0], 16)
    return (lo | (hi << 4)).to(torch.int8) - 32


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K, 84 bytes:  | scales 16 (low nibble: scale, high: min) | qs 64 | d f16 | dmin f16 |

    16 groups of 16, codes as in :func:`q2_k_codes`. value = d*scale[j] * q - dmin*min[j].
    """
    n = b.shape[0]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (b[:, 0:16] & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (b[:, 0:16] >> 4).float()).reshape(n, 16, 1)
    return (dl * q2_k_codes(b[:, 16:80]).float() - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K, 110 bytes:  | hmask 32 | qs 64 | scales 12 | d f16 |

    16 groups of 16, codes -4..3 (:func:`q3_k_codes`). value = d*(scale[j] - 32) * q.
    """
    n = b.shape[0]
    dl = (_f16(b[:, 108:110]) * q3_k_scales(b[:, 96:108]).float()).reshape(n, 16, 1)
    return (dl * q3_k_codes(b).float()).reshape(n, QK_K)


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scale field shared by Q4_K and Q5_K into 8 six-bit scales and mins.

    byte:  0..3   4..7   8..11        (A..H = scales of sub-blocks 0..7, a..h = mins)
          EEAAAAAA eeaaaaaa eeeeEEEE
          FFBBBBBB ffbbbbbb ffffFFFF
          GGCCCCCC ggcccccc ggggGGGG
          HHDDDDDD hhdddddd hhhhHHHH
    Sub-blocks 0..3 use the low 6 bits of bytes 0..7; sub-blocks 4..7 take 4 low bits
    from bytes 8..11 and their top 2 bits from the spare bits of bytes 0..7.
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K, 144 bytes:  | d f16 | dmin f16 | scales 12 | qs 128 |

    8 sub-blocks of 32; each 32-byte run of qs holds two sub-blocks (low nibbles, then
    high). value = d * scale[j] * q - dmin * min[j].
    """
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q5_K, 176 bytes:  | d f16 | dmin f16 | scales 12 | qh 32 | qs 128 |

    As Q4_K, plus a fifth bit: bit j of qh[i] is the high bit of value i of sub-block j.
    """
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], range(8), 0x01, 32).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K, 210 bytes:  | ql 128 | qh 64 | scales int8 x16 | d f16 |

    Two halves of 128 values. In half h, 32-value group t (0..3) takes its low 4 bits from
    ql[64h + 32(t%2) : +32] (low nibbles for t<2, high for t>=2) and its top 2 bits from
    bits 2t..2t+1 of qh[32h : 32h+32]. value = d * scale[k] * (q - 32), k = 16-value group.
    """
    n = b.shape[0]
    ql = _nibbles(b[:, 0:128], 64).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192], range(0, 8, 2), 0x03, 32).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, QK_K)


# --------------------------------------------------------------------------- IQ4 (non-uniform 4-bit levels)

def iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """[n, k*16] bytes of 4-bit indices (as Q4_0's nibbles, per 16 bytes) -> int8 levels
    [n, k, 32] from KVALUES_IQ4NL."""
    return KVALUES_IQ4NL[_nibbles(qs, 16).reshape(qs.shape[0], -1, 32).long()]


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's eight 6-bit scales minus 32, int8 [n, 8] (-32..31).

    Scale j: low 4 bits from scales_l[j // 2] (low nibble for even j: interleaved per byte,
    unlike the codes), top 2 bits from bits 2j..2j+1 of the little-endian u16 scales_h.
    """
    sl = b[:, 4:8]
    lo = torch.stack([sl & 0x0F, sl >> 4], dim=2).reshape(b.shape[0], 8)
    hi = _bits(b[:, 2:4], range(0, 8, 2), 0x03, 1).reshape(b.shape[0], 8)
    return (lo | (hi << 4)).to(torch.int8) - 32


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """IQ4_NL, 18 bytes:  | d f16 | qs 16 (as Q4_0) |   value = d * KVALUES_IQ4NL[q]"""
    return _f16(b[:, :2]) * iq4_levels(b[:, 2:]).reshape(b.shape[0], 32).float()


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS, 136 bytes:  | d f16 | scales_h u16 | scales_l 4 | qs 128 |

    8 groups of 32, each 16-byte run of qs one group (as IQ4_NL).
    value = d*(scale[j] - 32) * KVALUES_IQ4NL[q].
    """
    n = b.shape[0]
    dl = (_f16(b[:, :2]) * iq4_xs_scales(b).float()).reshape(n, 8, 1)
    return (dl * iq4_levels(b[:, 8:]).float()).reshape(n, QK_K)


_BLOCK_KERNELS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q2_K: _q2_k,
    QType.Q3_K: _q3_k,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
}

# numpy dtype whose bytes are the element, for the unquantized types
_FLOAT_TYPES: dict[QType, np.dtype] = {
    QType.F32: np.dtype(np.float32),
    QType.F16: np.dtype(np.float16),
    QType.BF16: np.dtype(np.int16),  # bf16 has no numpy dtype: carry the bits as int16
}

assert {t.name for t in [*_BLOCK_KERNELS, *_FLOAT_TYPES]} == set(SUPPORTED_GGUF_TYPES)


# --------------------------------------------------------------------------- public entry point

def is_supported(qtype: QType) -> bool:
    """True when :func:`dequantize` has a kernel for ``qtype``."""
    return qtype in _BLOCK_KERNELS or qtype in _FLOAT_TYPES


def _qtype_name(qtype: QType | int) -> str:
    try:
        return QType(qtype).name
    except ValueError:
        return f"unknown type id {int(qtype)}"


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one GGUF tensor to a float32 torch tensor of ``shape``.

    ``raw`` is what ``GGUFReader`` gives as ``tensor.data``: uint8 bytes for quantized
    types (and sometimes BF16), or a float16/float32 array for F16/F32 (uint8 bytes of
    those are accepted too). BF16 may come as uint8, uint16 or int16. ``shape`` is in
    numpy order (the reverse of GGUF's ``ne``), e.g. ``(rows, cols)``; quantized blocks run
    along the last axis. The result owns its memory (it does not alias the mmap).

    Raises ModelLoadError for an unsupported type or a byte count that does not match.
    """
    if not isinstance(qtype, QType) and int(qtype) in QType._value2member_map_:
        qtype = QType(qtype)
    if not isinstance(qtype, QType) or not is_supported(qtype):
        raise ModelLoadError(f"GGUF tensor type {_qtype_name(qtype)} is not supported "
                             f"(supported: {', '.join(SUPPORTED_GGUF_TYPES)})")
    n_elems = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n_elems % block_size or (len(shape) and shape[-1] % block_size):
        raise ModelLoadError(f"GGUF {qtype.name} tensor of shape {tuple(shape)}: the last "
                             f"dimension is not a multiple of the block size {block_size}")
    n_bytes = n_elems // block_size * type_size
    arr = np.ascontiguousarray(raw)
    if arr.nbytes != n_bytes:
        raise ModelLoadError(f"GGUF {qtype.name} tensor of shape {tuple(shape)} needs {n_bytes} "
                             f"bytes but has {arr.nbytes} (corrupt file?)")
    # np.array(copy) so torch gets a writable buffer it owns; GGUFReader's mmap is read-only.
    raw_bytes = torch.from_numpy(np.array(arr.reshape(-1).view(np.uint8)))

    if qtype in _FLOAT_TYPES:
        out = _decode_float(raw_bytes, qtype)
    else:
        out = _BLOCK_KERNELS[qtype](raw_bytes.reshape(-1, type_size))
    return out.reshape(tuple(shape))


def _decode_float(raw_bytes: torch.Tensor, qtype: QType) -> torch.Tensor:
    """F32/F16/BF16 from raw little-endian bytes."""
    if qtype == QType.F32:
        return raw_bytes.view(torch.float32)
    if qtype == QType.F16:
        return raw_bytes.view(torch.float16).float()
    return raw_bytes.view(torch.bfloat16).float()  # BF16 -> f32 is exact: append 16 zero bits
