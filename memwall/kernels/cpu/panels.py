"""q4/q8 weights packed into 16-row panels once at load, and the matmuls that read them
(packed_gemm.c; its header comment has the byte layout and the arithmetic).

Why: decode batches of 2-16 tokens (continuous batching, speculative verification) spent most
of a step in int8_dot.c's row kernels, which unpack every 32-value block once per row and end
every row in a reduction across lanes. In panels, one vpdpbusd multiplies 16 rows by 4 inputs
of a token and no reduction is left, and up to 16 tokens compute each row alike, so a batch's
rows are bit-identical to one-token calls.

    pack_(weight)       PackedWeight q4 / q8 -> kind "panels", permuting its tensors in place
                        (no second copy: a packed weight takes the memory it took before)
    unpack_(weight)     the inverse, in place, bit for bit
    unpacked_copy(w)    a row-layout copy (tensor-parallel cuts, AMX prefill)
    fits(weight)        whether pack_ takes it: q4, or q8 with a 32-value group; float32 or
                        float16 tables, or two-level ones with 8 sub-values a superblock
                        (GGUF's Q4_K, Q5_K); q8 in 16-value groups with two-level tables of 16
                        sub-values and no offsets (Q6_K); N a multiple of 16
    matmul(x, weight)   x float32 [M, K] -> [M, N]
    rows(weight, ids)   rows of the weight as float32 (an embedding tied to a packed LM head)

Packing happens only where ``available()``: the kernels are built with AVX-512 VNNI and
MEMWALL_PANELS is not 0 (=0 keeps every weight in the row layout, for A/B runs).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from memwall.kernels.cpu import amx, build
from memwall.kernels.cpu.layout import (PANEL_G16, PANEL_HALF, PANEL_OFFSETS, PANEL_Q8, PANEL_TWO_LEVEL,
                                        LayoutError, PackedWeight, check_input, scale_format,
                                        table_ptr)

ROWS = 16  # a panel's rows: one 32-bit lane each
BLOCK = 32  # inputs a scale (and a panel block)
SUPER = 8  # blocks a superblock of a two-level table (Q4_K, Q5_K: 256 values)
_CHUNK_ROWS = 4096  # rows permuted at a time: the scratch stays small for a 128k-row LM head
# (each chunk is permuted into a fresh copy, then written back: with one block a row the
# permutation is the identity and torch would hand back the chunk itself)

__all__ = ["available", "fits", "matmul", "pack_", "rows", "unpack_", "unpacked_copy"]


def available() -> bool:
    """Whether weights get packed here (AVX-512 VNNI kernels, MEMWALL_PANELS not 0)."""
    if os.environ.get("MEMWALL_PANELS", "1") == "0" or not build.available():
        return False
    return bool(build.require().mw_packed_available())


def fits(weight: PackedWeight) -> bool:
    """Whether ``pack_`` takes this weight (the module docstring)."""
    if weight.kind not in ("q4", "q8") or weight.n % ROWS:
        return False
    if weight.group == 16:  # Q6_K only
        return (weight.kind == "q8" and weight.scales.dim() == 3 and weight.offsets is None
                and scale_format(weight.scales) == 16 and weight.k % 256 == 0)
    if weight.group != BLOCK:
        return False
    if weight.scales.dim() == 3 and (scale_format(weight.scales) != SUPER or weight.k % (SUPER * BLOCK)):
        return False
    return weight.offsets is None or (weight.offsets.dtype == weight.scales.dtype
                                      and weight.offsets.dim() == weight.scales.dim())


def pack_(weight: PackedWeight) -> PackedWeight:
    """Permutes the weight's codes and tables in place into panels and returns it as kind
    "panels" (the same tensors). Anything else holding these tensors (a tied embedding) must
    read them through ``rows`` from now on. LayoutError when ``fits`` says no."""
    if not fits(weight):
        raise LayoutError(f"a {weight.kind} weight [{weight.n}, {weight.k}] in groups of "
                          f"{weight.group} does not fit 16-row panels")
    _permute(weight, weight.kind == "q8", pack=True)
    two_level = weight.scales.dim() == 3
    flags = ((PANEL_Q8 if weight.kind == "q8" else 0)
             | (PANEL_HALF if weight.scales.dtype == torch.float16 else 0)
             | (PANEL_TWO_LEVEL if two_level and weight.group == BLOCK else 0)
             | (PANEL_G16 if weight.group == 16 else 0)
             | (PANEL_OFFSETS if weight.offsets is not None else 0))
    return dataclasses.replace(weight, kind="panels", flags=flags)


def unpack_(weight: PackedWeight) -> PackedWeight:
    """The inverse of ``pack_``, in place: the row layout again (q4 or q8), bit for bit."""
    _check_packed(weight)
    q8 = bool(weight.flags & PANEL_Q8)
    _permute(weight, q8, pack=False)
    return dataclasses.replace(weight, kind="q8" if q8 else "q4", flags=0)


def unpacked_copy(weight: PackedWeight) -> PackedWeight:
    """A copy of a packed weight in the row layout (the weight itself stays packed)."""
    _check_packed(weight)
    return unpack_(dataclasses.replace(
        weight, codes=weight.codes.clone(), scales=weight.scales.clone(),
        offsets=None if weight.offsets is None else weight.offsets.clone()))


def matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] = x @ W^T (the bias is the caller's, as with
    quant_ops). Past amx.MIN_TOKENS, on CPUs where AMX measured faster, a copy of the weight
    is unpacked for amx.py's split-bf16 tiles."""
    _check_packed(weight)
    check_input(x, weight.k, "panels.matmul")
    m = x.shape[0]
    lib = build.require()
    if m and lib.mw_int_acts_on() and amx.use_for(m):
        plain = unpacked_copy(weight)
        return amx.matmul(plain.kind, x, plain.codes, plain.scales, plain.offsets)
    y = torch.empty(m, weight.n, dtype=torch.float32)
    if m and weight.n and not lib.mw_packed_gemm(
            x.data_ptr(), m, weight.k, weight.codes.data_ptr(), weight.scales.data_ptr(),
            table_ptr(weight.offsets), weight.flags, y.data_ptr(), weight.n, weight.n):
        raise LayoutError("packed weights need the AVX-512 VNNI kernels (panels.available())")
    return y


def rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 indices in 0..N-1, any shape) as float32 [..., K], each value
    s * q + c as the reference dequantizer rounds it."""
    _check_packed(weight)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= weight.n):
        raise IndexError(f"row index out of range 0..{weight.n - 1}")
    out = torch.empty(flat.numel(), weight.k, dtype=torch.float32)
    if flat.numel():
        build.require().mw_packed_rows(weight.codes.data_ptr(), weight.scales.data_ptr(),
                                       table_ptr(weight.offsets), weight.k, weight.flags,
                                       flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.view(*ids.shape, weight.k)


def _permute(weight: PackedWeight, q8: bool, pack: bool) -> None:
    """A weight's codes and tables into panel order (``pack``) or back, in place, a chunk of
    rows at a time. Codes: 32-bit word i of row r's block b goes to lane r of vector i
    ([groups, 16, nb, w] <-> [groups, nb, w, 16]); q8 codes also flip their top bit (signed
    codes + 128: vpdpbusd's unsigned operand; a byte-wise flip, so before or after the move)."""
    codes = weight.codes.view(torch.uint8)
    words = 8 if q8 else 4  # 32-bit words of a row's block
    nb = weight.k // BLOCK
    for r0 in range(0, weight.n, _CHUNK_ROWS):
        chunk = codes[r0:r0 + _CHUNK_ROWS]
        w = chunk.view(torch.int32)
        moved = (w.reshape(-1, ROWS, nb, words).permute(0, 2, 3, 1) if pack
                 else w.reshape(-1, nb, words, ROWS).permute(0, 3, 1, 2))
        chunk.copy_(moved.clone(memory_format=torch.contiguous_format).view(torch.uint8)
                    .reshape(chunk.shape))
        if q8:
            chunk.bitwise_xor_(0x80)
    for table in (weight.scales, weight.offsets):
        if table is not None:
            for r0 in range(0, weight.n, _CHUNK_ROWS):
                _permute_table(table[r0:r0 + _CHUNK_ROWS], pack)


def _permute_table(chunk: torch.Tensor, pack: bool) -> None:
    """A scale or offset table's rows (a multiple of 16) into panel order (``pack``) or back,
    in place. One entry a group: [16 rows, groups] -> [groups, 16]. Two-level: per superblock
    the 16 rows' float32 d side by side (64 bytes), then each sub-value for the 16 rows."""
    if chunk.dim() == 2:
        g, nb = chunk.shape[0] // ROWS, chunk.shape[1]
        shaped = (chunk.reshape(g, ROWS, nb) if pack else chunk.reshape(g, nb, ROWS)).permute(0, 2, 1)
        chunk.copy_(shaped.clone(memory_format=torch.contiguous_format).reshape(chunk.shape))
        return
    g, supers, width = chunk.shape[0] // ROWS, chunk.shape[1], chunk.shape[2]
    if pack:
        rows_ = chunk.reshape(g, ROWS, supers, width)
        d = rows_[..., :4].permute(0, 2, 1, 3).reshape(g, supers, ROWS * 4)
        sub = rows_[..., 4:].permute(0, 2, 3, 1).reshape(g, supers, -1)
        chunk.copy_(torch.cat([d, sub], dim=2).reshape(chunk.shape))
    else:
        lanes = chunk.reshape(g, supers, ROWS * width)
        d = lanes[..., :ROWS * 4].reshape(g, supers, ROWS, 4)
        sub = lanes[..., ROWS * 4:].reshape(g, supers, width - 4, ROWS).permute(0, 1, 3, 2)
        chunk.copy_(torch.cat([d, sub], dim=3).permute(0, 2, 1, 3).reshape(chunk.shape))


def _check_packed(weight: PackedWeight) -> None:
    if weight.kind != "panels":
        raise LayoutError(f"expected a packed weight (kind 'panels'), got kind {weight.kind!r}")
