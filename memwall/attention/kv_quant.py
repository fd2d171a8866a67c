"""KV cache number formats: which element types a cache may hold, how a float K/V row becomes
one, and how it is read back. Every backend writes and reads through here (the C kernels in
memwall/kernels/cpu/paged_attention.c compute the same bytes; tests/kernels/test_kv_quant.py
holds them to it).

    name   element            bytes per token and KV head (head_dim D)
    fp32   float32            4 D
    fp16   float16            2 D      values saturate at +-65504
    bf16   bfloat16           2 D
    fp8    float8_e4m3fn      D        values saturate at +-448, no scale
    int8   int8 + scales      D + 4 G  symmetric: scale = max|x| / 127 over each GROUP (16)
                                       values of one token and head, code = round(x / scale);
                                       G = ceil(D / 16) groups (the last may be shorter)

Why a scale per 16 values, not one per token and head: keys carry channels several times
larger than the rest, and one scale for all D values rounds the small ones coarsely. On the
embedded SmolLM2 (head_dim 64), benchmarks/quality.py's free-running greedy agreement against
fp32 KV was 84-88% with one scale a head and 95-98% with one per 16 values (fp16 KV: 100%),
for 16 more bytes a token and head (80 instead of 64 + 4; fp16 takes 128).

int8's scales live in a float32 tensor ``[num_blocks, block_size, kv_heads, G]`` that rides
on the cache tensor as its ``kv_scales`` attribute: the model code hands (K, V) pairs to the
backend without knowing the format, and the scales go wherever the cache goes (``allocate``,
``scales_of``, ``copy_blocks``).
"""

from __future__ import annotations

import torch

KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "int8": torch.int8, "fp8": torch.float8_e4m3fn,
}
# The CPU's `auto` with float32 compute. fp16 halves the bytes decode attention reads and its
# 11-bit mantissa is far below the model's own noise: benchmarks/quality.py measured greedy
# agreement and perplexity of fp16 KV against fp32 KV on the embedded SmolLM2 (see
# benchmarks/results/quality-*.json, "kv_cache_dtype": "fp16").
CPU_AUTO = "fp16"
NATIVE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.float8_e4m3fn: 4,
}
"""The MW_KV_* codes of memwall/kernels/cpu/kernels.h."""
SCALE_DTYPE = torch.float32
INT8_MAX = 127.0
GROUP = 16
"""int8 values sharing one scale (kernels.h MW_KV_GROUP)."""
SATURATE = {torch.float16: torch.finfo(torch.float16).max,
            torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}


def name_of(dtype: torch.dtype) -> str:
    return next((n for n, d in KV_DTYPES.items() if d == dtype), str(dtype))


def has_scales(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def groups(head_dim: int) -> int:
    """Scales a token and head of an int8 cache."""
    return -(-head_dim // GROUP)


def bytes_per_token_head(dtype: torch.dtype, head_dim: int) -> int:
    """What one token's K (or V) of one KV head costs, scales included."""
    elem = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if has_scales(dtype) else 0
    return head_dim * elem + scale * groups(head_dim)


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """An int8 cache's shape [..., head_dim] -> its scales' [..., groups(head_dim)]."""
    return (*shape[:-1], groups(shape[-1]))


def scales_of(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, block_size, kv_heads, groups] float32 for an int8 cache, else None."""
    return getattr(cache, "kv_scales", None)


def attach_scales(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    want = scales_shape(tuple(cache.shape))
    if tuple(scales.shape) != want or scales.dtype != SCALE_DTYPE:
        raise ValueError(f"int8 KV scales must be {SCALE_DTYPE} {list(want)}, got "
                         f"{scales.dtype} {list(scales.shape)}")
    cache.kv_scales = scales
    return cache


def allocate(shape: tuple[int, ...], dtype: torch.dtype, make) -> torch.Tensor:
    """``make(shape, dtype)`` -> a zeroed cache; int8 gets its (zeroed) scales attached."""
    cache = make(shape, dtype)
    if has_scales(dtype):
        attach_scales(cache, make(scales_shape(tuple(shape)), SCALE_DTYPE))
    return cache


def int8_cache(shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed int8 cache with its scales (tests and benchmarks that build caches by hand)."""
    return allocate(shape, torch.int8, lambda s, d: torch.zeros(s, dtype=d, device=device))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] float -> (values in ``dtype``, int8 scales [..., groups(D)] or None).
    Saturating: no value becomes inf or NaN in a format that cannot hold it."""
    if has_scales(dtype):
        head_dim, g = x.shape[-1], groups(x.shape[-1])
        padded = torch.nn.functional.pad(x.float(), (0, g * GROUP - head_dim))  # zeros: no max
        padded = padded.view(*x.shape[:-1], g, GROUP)
        scale = padded.abs().amax(dim=-1) / INT8_MAX  # [..., g]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(padded / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
        return codes.flatten(-2)[..., :head_dim].to(torch.int8), scale.to(SCALE_DTYPE)
    if dtype in SATURATE:
        x = x.clamp(-SATURATE[dtype], SATURATE[dtype])
    return x.to(dtype), None


def dequantize(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Cache values [..., D] (+ their scales [..., groups(D)]) -> float values; plain formats
    as they are (the attention upcasts them to the query's dtype)."""
    if scales is None:
        return data
    head_dim = data.shape[-1]
    return data.float() * scales.repeat_interleave(GROUP, dim=-1)[..., :head_dim]


def write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """x [num_tokens, kv_heads, D] float -> the cache's flat slots, in the cache's format."""
    kv_heads, head_dim = x.shape[1], x.shape[2]
    data, scales = quantize(x, cache.dtype)
    flat = cache.view(-1, kv_heads, head_dim)
    if cache.element_size() == 1 and cache.dtype != torch.int8:
        # index_copy_ has no CPU float8 kernel: move the bytes as uint8, they are the same.
        flat, data = flat.view(torch.uint8), data.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, data)
    if scales is not None:
        scales_of(cache).view(-1, kv_heads, scales.shape[-1]).index_copy_(0, slot_mapping, scales)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """dst[dst_ids] = src[src_ids], scales too (swap preemption, copy-on-write)."""
    dst[dst_ids] = src[src_ids].to(dst.device)
    src_scales, dst_scales = scales_of(src), scales_of(dst)
    if src_scales is not None:
        dst_scales[dst_ids] = src_scales[src_ids].to(dst_scales.device)
