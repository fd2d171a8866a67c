"""The attention entry points the model calls: ``write_kv`` and ``paged_attention``, routed to
the backend the step's metadata names.

    torch   memwall/attention/paged_torch.py    the readable reference (cpu, or cuda without triton)
    triton  memwall/attention/triton_backend.py the GPU kernels (cuda with triton)

The runner picks once (``choose``) and stamps the choice on every ``AttentionMetadata`` it
builds, so the model stays backend-agnostic and there is no global switch. The triton module
is imported only when a step asks for it: a CPU run never imports triton.

An fp8 KV cache (``torch.float8_e4m3fn``) is handled here for both backends: new K/V are
clamped to the format's range (+-448, no scale: the cache holds the values themselves) and
converted before the write; both backends upcast what they read to the query's dtype before
any matmul.
"""

from __future__ import annotations

import torch

from memwall.attention import paged_torch
from memwall.attention.metadata import AttentionMetadata

BACKENDS = ("torch", "triton")
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


def choose(device: torch.device | str) -> str:
    """triton on a CUDA device where triton can compile, else the torch reference."""
    if torch.device(device).type != "cuda":
        return "torch"
    from memwall.attention import triton_backend
    return "triton" if triton_backend.available() else "torch"


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] -> their slots (``meta.slot_mapping``) of the cache."""
    if k_cache.dtype in FP8_KV_DTYPES:
        k, v = to_fp8(k, k_cache.dtype), to_fp8(v, v_cache.dtype)
        if meta.backend == "torch":
            # index_copy_ has no CPU float8 kernel: move the bytes as uint8, they are the same.
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            k, v = k.view(torch.uint8), v.view(torch.uint8)
    if meta.backend == "triton":
        from memwall.attention import triton_backend
        triton_backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    else:
        paged_torch.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]."""
    if meta.backend == "triton":
        from memwall.attention import triton_backend
        return triton_backend.paged_attention(q, k_cache, v_cache, meta, scale)
    native = q.dtype == torch.float32 and k_cache.dtype == torch.float32 and _native_decode_ok(q)
    return paged_torch.paged_attention(q, k_cache, v_cache, meta, scale,
                                       decode=_native_decode if native else None)


def _native_decode_ok(q: torch.Tensor) -> bool:
    if q.device.type != "cpu":
        return False
    from memwall.quant import native
    return native.available()


def _native_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
    """The one-token rows of a CPU step through memwall/kernels/cpu/decode.c: each sequence's
    blocks are read where they lie, where the torch reference gathers a padded copy of them."""
    from memwall.kernels.cpu.decode import paged_decode_attention
    batch = meta.decode
    out[batch.token_index] = paged_decode_attention(q[batch.token_index], k_cache, v_cache,
                                                    batch.block_tables, batch.seq_lens, scale)


def to_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Saturating conversion: out-of-range values become +-448 (never NaN), on every device."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
