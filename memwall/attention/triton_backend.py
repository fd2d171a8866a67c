"""The Triton attention backend: paged_torch's two calls, ``write_kv`` and ``paged_attention``, on the GPU.

A drop-in for memwall/attention/paged_torch.py (same signatures, same results to rounding).
The kernels take device tensors; the host-side lists of ``AttentionMetadata`` become one small
int32 upload per step, laid out as

    [ query_start (S+1) | seq_lens (S) | decode_seqs (B) | prefill work (2P) ]

where prefill work lists one (sequence, first query index) pair per program. The plan is built
at the first layer that sees a metadata object and kept on that object, so the other layers of
the step reuse it (no global state; the plan dies with the step's metadata).

CUDA graphs (memwall/worker/cuda_graphs.py) cannot rebuild a plan per step: they attach a
*static* decode plan to a metadata object made of persistent device buffers
(``attach_static_decode_plan``); its splits are sized on the device from each sequence's own
length, so replaying the graph needs no host value that changes between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.kernels.triton import TRITON_AVAILABLE
from memwall.kernels.triton.paged_attention import (PREFILL_BLOCK_M, TILE_N, decode_attention,
                                                    prefill_attention, prefill_block_q,
                                                    prefill_work, reshape_and_cache)

_PLAN_ATTR = "_triton_plans"  # where the plans live on an AttentionMetadata, by block_q
_STATIC = "static"  # the key of a static decode plan, valid for any block_q


def available() -> bool:
    """True where this backend can run compiled kernels (triton and a CUDA device)."""
    return TRITON_AVAILABLE and torch.cuda.is_available()


@dataclass(frozen=True)
class TritonAttentionPlan:
    """The device-side view of one step's AttentionMetadata."""

    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    decode_seqs: torch.Tensor  # [B] int32, the sequences with one query token
    prefill_work: torch.Tensor  # [P, 2] int32, (sequence, first query index) per program
    max_decode_len: int
    """Longest decode context: sizes the decode splits."""
    num_splits: int | None = None
    """Decode splits fixed by the plan (None: chosen per call)."""
    dynamic_split: bool = False
    """Each decode sequence sizes its own splits on the device (graph-safe)."""

    @classmethod
    def build(cls, meta: AttentionMetadata, block_q: int) -> "TritonAttentionPlan":
        num_seqs, decodes = meta.num_seqs, meta.decode_seq_ids
        work = prefill_work(meta.query_start, meta.prefill_seq_ids, block_q)
        flat = list(meta.query_start) + list(meta.seq_lens) + list(decodes) + work
        buf = torch.tensor(flat, dtype=torch.int32, device=meta.block_tables.device)
        parts = buf.split([num_seqs + 1, num_seqs, len(decodes), len(work)])
        return cls(query_start=parts[0], seq_lens=parts[1], decode_seqs=parts[2],
                   prefill_work=parts[3].view(-1, 2),
                   max_decode_len=max((meta.seq_lens[s] for s in decodes), default=0))

    @classmethod
    def of(cls, meta: AttentionMetadata, block_q: int) -> "TritonAttentionPlan":
        """The plan cached on ``meta`` (built on first use)."""
        plans = meta.__dict__.setdefault(_PLAN_ATTR, {})
        if _STATIC in plans:  # decode only: block_q (a prefill setting) does not matter
            return plans[_STATIC]
        if block_q not in plans:
            plans[block_q] = cls.build(meta, block_q)
        return plans[block_q]


def attach_static_decode_plan(meta: AttentionMetadata, query_start: torch.Tensor,
                              seq_lens: torch.Tensor, decode_seqs: torch.Tensor, max_len: int,
                              num_splits: int) -> TritonAttentionPlan:
    """Pins a decode-only plan on ``meta`` that reads the given device buffers as they are when
    a kernel runs (query_start [B+1], seq_lens [B], decode_seqs [B] int32): the caller rewrites
    their contents between graph replays. ``max_len`` bounds every seq_len."""
    if meta.prefill_seq_ids:
        raise ValueError("a static plan serves decode-only steps; this metadata has prefills")
    empty = torch.empty(0, 2, dtype=torch.int32, device=seq_lens.device)
    plan = TritonAttentionPlan(query_start=query_start, seq_lens=seq_lens, decode_seqs=decode_seqs,
                               prefill_work=empty, max_decode_len=max_len, num_splits=num_splits,
                               dynamic_split=True)
    meta.__dict__.setdefault(_PLAN_ATTR, {})[_STATIC] = plan
    return plan


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] go to the flat slots of the cache."""
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, block_m: int = PREFILL_BLOCK_M,
                    tile_n: int = TILE_N, num_splits: int | None = None, num_warps: int = 4,
                    num_stages: int = 2) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim].

    The keyword arguments are tuning knobs (prefill rows per program, keys per inner step,
    decode splits with None picking by device, Triton's warps and pipeline stages); the model
    calls without them.
    """
    if q.device != meta.block_tables.device:
        raise ValueError(f"q is on {q.device} but the attention metadata is on "
                         f"{meta.block_tables.device}; build AttentionMetadata with device=q.device")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = TritonAttentionPlan.of(meta, prefill_block_q(q.shape[1], k_cache.shape[2], block_m))
    tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    if meta.decode_seq_ids:
        decode_attention(out, q, k_cache, v_cache, tables, plan.query_start, plan.seq_lens,
                         plan.decode_seqs, plan.max_decode_len, scale,
                         num_splits=num_splits if num_splits is not None else plan.num_splits,
                         tile_n=tile_n, num_warps=num_warps, num_stages=num_stages,
                         dynamic_split=plan.dynamic_split)
    if meta.prefill_seq_ids:
        prefill_attention(out, q, k_cache, v_cache, tables, plan.query_start, plan.seq_lens,
                          plan.prefill_work, scale, block_m=block_m, tile_n=tile_n,
                          num_warps=num_warps, num_stages=num_stages)
    return out
