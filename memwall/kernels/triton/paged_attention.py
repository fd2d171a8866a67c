"""Paged attention in Triton: KV writes, prefill (varlen, causal, chunked) and split-K decode.

What belongs here: the kernels and their launchers, which take plain tensors. Turning an
``AttentionMetadata`` into those tensors is the backend's job (memwall/attention/triton_backend.py).

The cache of one layer is a pair ``[num_blocks, block_size, kv_heads, head_dim]``; sequence s
reads its tokens through ``block_tables[s]``. Key position n of s lives at

    block_tables[s, n // block_size], row n % block_size

so a tile of TILE_N keys is gathered token by token (TILE_N need not match block_size).

GQA: one program serves all ``group = heads // kv_heads`` query heads of one KV head, so each
K/V tile is loaded once per group, not once per head. Its rows are (query token, head) pairs:

    row r  ->  query token  r // GROUP_P2,   head  kv_head * group + r % GROUP_P2

(the group is padded to a power of two; padded rows load zeros and are not stored).

Causality with an offset: query i of a sequence with ``q_len`` new tokens and ``seq_len`` keys
sits at position ``seq_len - q_len + i`` and sees keys 0..that position. This covers prefill
from scratch, chunked prefill on a cached prefix and decode alike. Softmax is the online one
(running max m, running sum l, unnormalized accumulator), in base 2: the scale is folded with
log2(e) so the inner loop uses exp2.

Decode (one query token per sequence) uses split-K ("flash decoding"): with few sequences one
program per (sequence, KV head) would leave most of the GPU idle, so each sequence's keys are
cut into ``num_splits`` ranges, attended in parallel into partial (m, l, acc), then merged by a
small reduce kernel. With one split the decode kernel writes the output itself.
"""

import math

import torch

from memwall.kernels.triton import require_triton, tl, triton

LOG2_E = 1.4426950408889634
PREFILL_BLOCK_M = 64
"""Rows (query token x head pairs) per prefill program; tl.dot needs at least 16."""
TILE_N = 64
"""Keys per inner-loop step."""


# ---------------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------------

@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):
    """One program per token: all its KV heads go to its slot (a negative slot is padding)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_P2)
        dims = tl.arange(0, HEAD_DIM_P2)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
               + heads[:, None] * stride_ch + dims[None, :])  # [HEADS_P2, HEAD_DIM_P2]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] -> their slots of the caches (cast to the cache dtype).

    ``slot_mapping[t] = block * block_size + offset``; a negative slot skips token t (padding).
    """
    require_triton()
    tokens, kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, kv_heads, head_dim)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if tokens == 0:
        return
    _reshape_and_cache_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        kv_heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(kv_heads), HEAD_DIM_P2=triton.next_power_of_2(head_dim),
    )


# ---------------------------------------------------------------------------------------------
# The shared inner loop
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attend_keys(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                 lo, hi, stride_cb, stride_cs, stride_ch, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_P2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of q [BLOCK_M, D] over keys lo..hi-1, row r seeing keys <= q_pos[r].

    acc [BLOCK_M, D] (unnormalized), m_i and l_i [BLOCK_M] (log2-domain max and sum) are
    carried in and returned updated. ``lo`` must be a multiple of TILE_N.
    """
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    for start in range(lo, hi, TILE_N):
        keys = start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        key_ok = keys < hi
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        row = block * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [TILE_N]
        k = tl.load(k_cache_ptr + row[None, :] + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, TILE_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# ---------------------------------------------------------------------------------------------
# Prefill: many query tokens per sequence
# ---------------------------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, work_ptr,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_tables,
    stride_cb, stride_cs, stride_ch, qk_scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (work items, kv_heads). Work item = (sequence, first query index of its block)."""
    BLOCK_Q = BLOCK_M // GROUP_P2
    seq = tl.load(work_ptr + 2 * tl.program_id(0))
    first_q = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    qi = first_q + rows // GROUP_P2  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (qi < q_len) & (rows % GROUP_P2 < GROUP)
    dims = tl.arange(0, HEAD_DIM_P2)
    io_mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    token = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D]

    q_pos = seq_len - q_len + qi  # causal with an offset: cached tokens come first
    hi = tl.minimum(seq_len, seq_len - q_len + first_q + BLOCK_Q)  # the block's last query sees this far
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tables
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
                                 0, hi, stride_cb, stride_cs, stride_ch, qk_scale,
                                 BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P2, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_block_q(num_heads: int, num_kv_heads: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Query tokens per prefill program: block_m rows hold block_q tokens x the padded group."""
    group_p2 = _next_pow2(num_heads // num_kv_heads)
    return _prefill_rows(group_p2, block_m) // group_p2


def _prefill_rows(group_p2: int, block_m: int) -> int:
    return max(block_m, group_p2, 16)


def prefill_work(query_start: list[int], seq_ids: list[int], block_q: int) -> list[int]:
    """Flat (sequence, first query index) pairs, one per prefill program."""
    work: list[int] = []
    for s in seq_ids:
        for first in range(0, query_start[s + 1] - query_start[s], block_q):
            work += [s, first]
    return work


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
                      seq_lens: torch.Tensor, work: torch.Tensor, scale: float, *,
                      block_m: int = PREFILL_BLOCK_M, tile_n: int = TILE_N,
                      num_warps: int = 4, num_stages: int = 2) -> None:
    """Causal attention of the prefill chunks listed in ``work``, written into ``out``.

    q, out: [num_tokens, heads, head_dim]; block_tables [num_seqs, max_blocks] int;
    query_start [num_seqs + 1] and seq_lens [num_seqs] int32 on q's device;
    work: [num_items, 2] int32 from ``prefill_work`` with the same ``block_m``.
    """
    require_triton()
    heads, group, head_dim = _check_attention(q, out, k_cache, v_cache, block_tables)
    _check_tiles(block_m=block_m, tile_n=tile_n)
    group_p2 = _next_pow2(group)
    block_m = _prefill_rows(group_p2, block_m)
    if work.numel() == 0:
        return
    _prefill_kernel[(work.shape[0], heads // group)](
        out, q, k_cache, v_cache, block_tables, query_start, seq_lens, work,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2_E,
        GROUP=group, GROUP_P2=group_p2, BLOCK_M=block_m, BLOCK_SIZE=k_cache.shape[1],
        TILE_N=tile_n, HEAD_DIM=head_dim, HEAD_DIM_P2=_next_pow2(head_dim),
        DOT_PRECISION=_dot_precision(q), num_warps=num_warps, num_stages=num_stages,
    )


# ---------------------------------------------------------------------------------------------
# Decode: one query token per sequence, keys split across programs
# ---------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr,
    query_start_ptr, seq_lens_ptr, seqs_ptr, split_len,
    stride_ot, stride_oh, stride_qt, stride_qh, stride_tables,
    stride_cb, stride_cs, stride_ch, qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DYNAMIC_SPLIT: tl.constexpr,
):
    """Grid (decodes, kv_heads, splits). Rows are the group's query heads, padded to BLOCK_M.

    ``split_len`` keys per split, or with DYNAMIC_SPLIT each sequence's own seq_len cut into
    NUM_SPLITS tile-aligned ranges (nothing sized on the host: what a CUDA graph replays)."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(seqs_ptr + b)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_P2)
    io_mask = (rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D]

    if DYNAMIC_SPLIT:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    lo = split * split_len
    hi = tl.minimum(seq_len, lo + split_len)
    q_pos = tl.full([BLOCK_M], 0, dtype=tl.int32) + seq_len - 1  # the new token sees every key
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tables
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
                                 lo, hi, stride_cb, stride_cs, stride_ch, qk_scale,
                                 BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P2, DOT_PRECISION)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:  # partials [decodes, heads, splits, ...]; an empty split leaves m = -inf, l = 0
        part = (b * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :], acc,
                 mask=rows[:, None] < GROUP)
        tl.store(part_ml_ptr + 2 * part, m_i, mask=rows < GROUP)
        tl.store(part_ml_ptr + 2 * part + 1, l_i, mask=rows < GROUP)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_start_ptr, seqs_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):
    """Grid (decodes, heads): merges the splits' (m, l, acc) into one normalized row."""
    b, head = tl.program_id(0), tl.program_id(1)
    token = tl.load(query_start_ptr + tl.load(seqs_ptr + b)).to(tl.int64)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, HEAD_DIM_P2)
    part = (b * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + splits  # [SPLITS_P2]
    split_ok = splits < NUM_SPLITS
    m = tl.load(part_ml_ptr + 2 * part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + 2 * part + 1, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P2 + dims[None, :],
                  mask=split_ok[:, None], other=0.0)  # [SPLITS_P2, D]
    m_max = tl.max(m, 0)  # finite: split 0 always holds key 0
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                  tile_n: int = TILE_N) -> int:
    """Enough splits to give the GPU ~2 programs per multiprocessor, each >= 4 key tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = math.ceil(2 * sms / max(1, num_decodes * num_kv_heads))
    return max(1, min(wanted, math.ceil(max_seq_len / (4 * tile_n)), 64))


def decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
                     seq_lens: torch.Tensor, decode_seqs: torch.Tensor, max_seq_len: int,
                     scale: float, *, num_splits: int | None = None, tile_n: int = TILE_N,
                     num_warps: int = 4, num_stages: int = 2, dynamic_split: bool = False) -> None:
    """Attention of the one-token sequences ``decode_seqs`` [B] int32 over their whole cache.

    Shapes as ``prefill_attention``; ``max_seq_len`` bounds seq_lens[decode_seqs] (it sizes
    the splits). ``num_splits`` None picks one from the device (``decode_splits``).
    ``dynamic_split``: the kernel sizes each sequence's splits from its own length on the
    device, so the launch depends on no per-step host value (CUDA-graph safe; memwall/worker/
    cuda_graphs.py passes max_seq_len = the context window and a fixed ``num_splits``).
    """
    require_triton()
    heads, group, head_dim = _check_attention(q, out, k_cache, v_cache, block_tables)
    _check_tiles(tile_n=tile_n)
    num_decodes = decode_seqs.numel()
    if num_decodes == 0:
        return
    if num_splits is None:
        num_splits = decode_splits(num_decodes, heads // group, max_seq_len, q.device, tile_n)
    split_len = math.ceil(math.ceil(max_seq_len / num_splits) / tile_n) * tile_n
    if not dynamic_split:  # no split starts past max_seq_len
        num_splits = max(1, math.ceil(max_seq_len / split_len))
    head_dim_p2 = _next_pow2(head_dim)
    part_acc = part_ml = out  # unused with one split
    if num_splits > 1:
        part_acc = torch.empty(num_decodes, heads, num_splits, head_dim_p2, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_decodes, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_decodes, heads // group, num_splits)](
        out, part_acc, part_ml, q, k_cache, v_cache, block_tables, query_start, seq_lens,
        decode_seqs, split_len, out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale * LOG2_E, NUM_HEADS=heads, GROUP=group, BLOCK_M=max(16, _next_pow2(group)),
        NUM_SPLITS=num_splits, BLOCK_SIZE=k_cache.shape[1], TILE_N=tile_n, HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2, DOT_PRECISION=_dot_precision(q), DYNAMIC_SPLIT=dynamic_split,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, heads)](
            out, part_acc, part_ml, query_start, decode_seqs, out.stride(0), out.stride(1),
            NUM_HEADS=heads, NUM_SPLITS=num_splits, SPLITS_P2=_next_pow2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
        )


# ---------------------------------------------------------------------------------------------
# Checks shared by the launchers
# ---------------------------------------------------------------------------------------------

def _next_pow2(n: int) -> int:
    """triton.next_power_of_2, usable without triton."""
    return 1 << max(0, (n - 1).bit_length())


def _dot_precision(q: torch.Tensor) -> str:
    # float32 models get true float32 products (tf32 would cost ~3e-4 relative error);
    # 16-bit inputs ignore the setting.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_tiles(**sizes: int) -> None:
    for name, size in sizes.items():
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}={size}: tiles must be powers of two >= 16 (tl.dot's minimum)")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"K and V caches must match in shape and strides, got "
                         f"{tuple(k_cache.shape)}/{k_cache.stride()} and "
                         f"{tuple(v_cache.shape)}/{v_cache.stride()}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (kv_heads, head_dim) or k_cache.stride(3) != 1:
        raise ValueError(f"a KV cache must be [num_blocks, block_size, {kv_heads}, {head_dim}] with "
                         f"a contiguous last dim; got {tuple(k_cache.shape)}, strides {k_cache.stride()}")


def _check_attention(q, out, k_cache, v_cache, block_tables) -> tuple[int, int, int]:
    """Validates shapes; returns (heads, group, head_dim)."""
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    _check_cache(k_cache, v_cache, kv_heads, head_dim)
    if out.shape != q.shape or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"q and out must be [tokens, heads, head_dim] with a contiguous last dim; "
                         f"got q {tuple(q.shape)}/{q.stride()}, out {tuple(out.shape)}/{out.stride()}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be row-contiguous, got strides {block_tables.stride()}")
    if head_dim < 16:
        raise ValueError(f"head_dim {head_dim} is below the 16 that tl.dot needs")
    return heads, heads // kv_heads, head_dim
