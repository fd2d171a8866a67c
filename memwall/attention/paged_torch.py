"""Paged attention in plain torch: the readable reference every faster backend is checked against.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Each step first scatters the new tokens' K/V into their slots, then every sequence attends over
its own blocks: decodes in one padded batch, prefill chunks one by one with a causal mask that is
offset by the tokens already in the cache (so chunked prefill and prefix reuse come for free).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memwall.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] go to the flat slots of the cache."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]."""
    out = torch.empty_like(q)
    if meta.decode_seq_ids:
        _decode(q, k_cache, v_cache, meta, scale, out)
    for seq in meta.prefill_seq_ids:
        _prefill_one(q, k_cache, v_cache, meta, scale, out, seq)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[..., max_blocks] block ids -> [..., length, kv_heads, head_dim] tokens in order."""
    blocks = cache[block_table]  # [..., max_blocks, block_size, kv_heads, head_dim]
    flat = blocks.flatten(-4, -3)  # [..., max_blocks * block_size, kv_heads, head_dim]
    return flat[..., :length, :, :]


def _prefill_one(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, seq: int) -> None:
    start, end = meta.query_start[seq], meta.query_start[seq + 1]
    seq_len = meta.seq_lens[seq]
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[seq, :num_blocks]
    k = _gather(k_cache, table, seq_len)  # [seq_len, kv_heads, head_dim]
    v = _gather(v_cache, table, seq_len)
    q_len = end - start
    # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # [q_len, 1]
    mask = torch.arange(seq_len).unsqueeze(0) <= q_pos  # [q_len, seq_len]
    out[start:end] = _sdpa(q[start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                           mask.unsqueeze(0), scale)[0]


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
    seqs = meta.decode_seq_ids
    token_idx = torch.tensor([meta.query_start[s] for s in seqs])
    lens = torch.tensor([meta.seq_lens[s] for s in seqs])  # [B]
    max_len = int(lens.max())
    num_blocks = -(-max_len // meta.block_size)
    tables = meta.block_tables[seqs, :num_blocks]  # [B, num_blocks]
    k = _gather(k_cache, tables, max_len)  # [B, max_len, kv_heads, head_dim]
    v = _gather(v_cache, tables, max_len)
    mask = (torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, max_len]
    out[token_idx] = _sdpa(q[token_idx].unsqueeze(1), k, v, mask, scale).squeeze(1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q: [B, q_len, heads, D]; k, v: [B, kv_len, kv_heads, D]; mask: [B, q_len, kv_len] bool."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, len, D]
    if kv_heads != heads:  # grouped-query attention: each KV head serves heads / kv_heads queries
        k_t = k_t.repeat_interleave(heads // kv_heads, dim=1)
        v_t = v_t.repeat_interleave(heads // kv_heads, dim=1)
    o = F.scaled_dot_product_attention(q_t, k_t.to(q.dtype), v_t.to(q.dtype),
                                       attn_mask=mask.unsqueeze(1), scale=scale)
    return o.transpose(1, 2)  # [B, q_len, heads, D]
