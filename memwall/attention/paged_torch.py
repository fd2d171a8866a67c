"""Paged attention in plain torch: the readable reference every faster backend is checked against.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Each step first scatters the new tokens' K/V into their slots, then every sequence attends over
its own blocks: decodes in one padded batch, prefill chunks one by one with a causal mask that is
offset by the tokens already in the cache (so chunked prefill and prefix reuse come for free).
K/V are stored in the cache's format (memwall/attention/kv_quant.py) and dequantized as they
are gathered: an int8 cache carries its scales [num_blocks, block_size, kv_heads] beside it.

Gemma's options: a sliding ``window`` (a query at position p sees keys p - window + 1 .. p;
blocks wholly before a sequence's first visible key are not even gathered) and a logit
``softcap`` (scores become cap * tanh(score / cap) before the softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memwall.attention import kv_quant
from memwall.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] go to the flat slots of the cache."""
    kv_quant.write(k_cache, k, slot_mapping)
    kv_quant.write(v_cache, v, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, decode=None, window: int | None = None,
                    softcap: float | None = None, prefill=None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. ``decode``: another
    implementation of the one-token rows (``_decode``'s arguments and ``window=``, which it
    applies itself), e.g. a native kernel; ``prefill``: one of a sequence's chunk
    (q [chunk, heads, head_dim], k_cache, v_cache, its block table row, its length, scale,
    window=, out=: the rows of the result to write). Both are used unless a softcap applies."""
    out = torch.empty_like(q)
    if meta.decode_seq_ids:
        if decode is not None and softcap is None:
            decode(q, k_cache, v_cache, meta, scale, out, window=window)
        elif softcap is None and not window_cuts(meta, meta.decode_seq_ids, window):
            _decode(q, k_cache, v_cache, meta, scale, out)
        else:
            for seq in meta.decode_seq_ids:
                _attend_one(q, k_cache, v_cache, meta, scale, out, seq, window, softcap)
    for seq in meta.prefill_seq_ids:
        if prefill is not None and softcap is None:
            start, end = meta.query_start[seq], meta.query_start[seq + 1]
            prefill(q[start:end], k_cache, v_cache, meta.block_tables[seq], meta.seq_lens[seq],
                    scale, window=window, out=out[start:end])
        else:
            _attend_one(q, k_cache, v_cache, meta, scale, out, seq, window, softcap)
    return out


def window_cuts(meta: AttentionMetadata, seqs, window: int | None) -> bool:
    """Whether a window hides any key from these sequences' queries (else it changes nothing)."""
    return window is not None and max(meta.seq_lens[s] for s in seqs) > window


def _attend_one(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, seq: int,
                window: int | None = None, softcap: float | None = None) -> None:
    """One sequence's queries (a prefill chunk, or a decode row with a window or softcap):
    query i sits at position seq_len - q_len + i and sees keys up to that position."""
    start, end = meta.query_start[seq], meta.query_start[seq + 1]
    seq_len, q_len = meta.seq_lens[seq], end - start
    first_query = seq_len - q_len
    first_key = 0 if window is None else max(0, first_query - window + 1)
    first_block = first_key // meta.block_size  # earlier blocks hold no visible key
    num_blocks = -(-seq_len // meta.block_size)
    offset = first_block * meta.block_size
    table = meta.block_tables[seq, first_block:num_blocks]
    k = _gather(k_cache, table, seq_len - offset)  # [keys, kv_heads, head_dim] from `offset`
    v = _gather(v_cache, table, seq_len - offset)
    if q_len == seq_len and window is None and softcap is None:
        # the whole sequence: plain causal attention, which lets the kernel skip the masked
        # half of the score blocks (an explicit mask costs it all of them)
        out[start:end] = _sdpa(q[start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                               None, scale)[0]
        return
    q_pos = torch.arange(first_query, seq_len, device=q.device).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(offset, seq_len, device=q.device).unsqueeze(0)  # [1, keys]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if softcap is None:
        out[start:end] = _sdpa(q[start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                               mask.unsqueeze(0), scale)[0]
        return
    group = q.shape[1] // k.shape[1]
    qs = q[start:end].transpose(0, 1)  # [H, q_len, D]
    ks = k.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, keys, D]
    vs = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [H, q_len, keys]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out[start:end] = torch.matmul(probs, vs).transpose(0, 1)  # [q_len, H, D]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[..., max_blocks] block ids -> [..., length, kv_heads, head_dim] tokens in order."""
    blocks = cache[block_table]  # [..., max_blocks, block_size, kv_heads, head_dim]
    flat = blocks.flatten(-4, -3)  # [..., max_blocks * block_size, kv_heads, head_dim]
    scales = kv_quant.scales_of(cache)
    if scales is not None:  # [..., max_blocks * block_size, kv_heads, groups]
        scales = scales[block_table].flatten(-4, -3)[..., :length, :, :]
    return kv_quant.dequantize(flat[..., :length, :, :], scales)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
    batch = meta.decode
    k = _decode_keys(k_cache, batch)  # [B, max_len, kv_heads, head_dim]
    v = _decode_keys(v_cache, batch)
    kv_heads, head_dim = k.shape[2], k.shape[3]
    group = q.shape[1] // kv_heads
    # Grouped-query attention without repeating K/V: the `group` query heads of each KV head
    # form the rows of one matmul against that head's keys.
    q_b = q[batch.token_index].view(-1, kv_heads, group, head_dim)  # [B, Hkv, g, D]
    scores = torch.matmul(q_b, k.permute(0, 2, 3, 1).to(q.dtype)) * scale  # [B, Hkv, g, L]
    if batch.mask is not None:
        scores = scores + batch.mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.matmul(probs, v.transpose(1, 2).to(q.dtype))  # [B, Hkv, g, D]
    out[batch.token_index] = o.reshape(-1, kv_heads * group, head_dim)


def _decode_keys(cache: torch.Tensor, batch) -> torch.Tensor:
    if batch.contiguous_start is not None:  # one sequence on consecutive blocks: a view, no copy
        start, end = batch.contiguous_start, batch.contiguous_start + batch.num_blocks
        scales = kv_quant.scales_of(cache)
        if scales is not None:
            scales = scales[start:end].flatten(0, 1)[: batch.max_len].unsqueeze(0)
        data = cache[start:end].flatten(0, 1)[: batch.max_len].unsqueeze(0)
        return kv_quant.dequantize(data, scales)
    return _gather(cache, batch.block_tables, batch.max_len)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float):
    """q: [B, q_len, heads, D]; k, v: [B, kv_len, kv_heads, D]; mask: [B, q_len, kv_len] bool,
    or None for causal attention with q_len == kv_len."""
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, len, D]
    # grouped-query attention: each KV head serves heads / kv_heads queries, read in place
    # (repeating K/V for every query head cost a copy of the context per layer, ~15% of it)
    o = F.scaled_dot_product_attention(q_t, k_t.to(q.dtype), v_t.to(q.dtype),
                                       attn_mask=None if mask is None else mask.unsqueeze(1),
                                       is_causal=mask is None, scale=scale,
                                       enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)  # [B, q_len, heads, D]
