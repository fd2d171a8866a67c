"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket, replayed.

A decode step of a large model on a GPU is launch-bound at small batch sizes: hundreds of tiny
kernels whose launch costs more than their work. A CUDA graph records those launches once and
replays them with one call. Replay reads and writes the *same memory* it was captured with,
so every input lives in persistent buffers that each step overwrites:

    StaticDecodeBuffers (max bucket rows M, max_blocks = ceil(max_model_len / block_size))
      input_ids    [M]  int64     row i = decode sequence i of the step
      positions    [M]  int64
      slot_mapping [M]  int64     -1 on padding rows: the KV write skips them
      seq_lens     [M]  int32      1 on padding rows: attend to one (harmless) key
      block_tables [M, max_blocks] int64
      query_start  [M+1] int32    = arange (one query token per sequence), never rewritten
      decode_seqs  [M]  int32     = arange, never rewritten

A batch of n decodes runs the graph of the smallest bucket b >= n (1, 2, 4, ... 128, capped at
max_num_seqs); rows n..b-1 are padding and their outputs are dropped. The attention plan is
static (memwall/attention/triton_backend.py ``attach_static_decode_plan``): decode splits are
sized on the device from each sequence's length, so nothing in the captured region reads a
host value that changes between steps, and nothing syncs with the host.

Steps with a prefill chunk, more decodes than the largest bucket, or a CPU device run eagerly.
"""

from __future__ import annotations

import math

import torch

from memwall.attention.metadata import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def batch_buckets(max_num_seqs: int, buckets: tuple[int, ...] = BUCKETS) -> list[int]:
    """The bucket sizes to capture: those below ``max_num_seqs``, then ``max_num_seqs`` itself
    (so every batch the scheduler can form has a bucket), capped at the largest bucket."""
    cap = min(max_num_seqs, buckets[-1])
    return [b for b in buckets if b < cap] + [cap]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows; None if none does (run eagerly)."""
    return next((b for b in buckets if b >= num_seqs), None) if num_seqs > 0 else None


class StaticDecodeBuffers:
    """The persistent inputs of the captured decode graphs (layout in the module docstring).
    Device-agnostic: the padding logic is tested on CPU tensors."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device | str) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_rows, **long)
        self.positions = torch.zeros(max_rows, **long)
        self.slot_mapping = torch.full((max_rows,), -1, **long)
        self.block_tables = torch.zeros(max_rows, max_blocks, **long)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.decode_seqs = torch.arange(max_rows, dtype=torch.int32, device=device)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             seq_lens: torch.Tensor, block_tables: torch.Tensor, bucket: int) -> None:
        """Rows 0..n-1 take the step's decodes; rows n..bucket-1 become padding."""
        n, width = block_tables.shape
        if not n <= bucket <= self.max_rows or width > self.max_blocks:
            raise ValueError(f"{n} decodes x {width} blocks do not fit bucket {bucket} of "
                             f"{self.max_rows} rows x {self.max_blocks} blocks")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.pad(n, bucket)

    def pad(self, start: int, end: int) -> None:
        """Rows start..end-1 write no KV and attend to key 0 of block 0."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = 0

    def metadata(self, bucket: int, block_size: int, max_model_len: int,
                 num_splits: int) -> AttentionMetadata:
        """Decode-only triton metadata over the first ``bucket`` rows, with a static plan."""
        from memwall.attention.triton_backend import attach_static_decode_plan

        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start=list(range(bucket + 1)),
            seq_lens=[1] * bucket,  # host copy unused by the static plan; kept for num_seqs
            block_tables=self.block_tables[:bucket], block_size=block_size,
            decode_seq_ids=list(range(bucket)), prefill_seq_ids=[], backend="triton")
        attach_static_decode_plan(meta, self.query_start[:bucket + 1], self.seq_lens[:bucket],
                                  self.decode_seqs[:bucket], max_model_len, num_splits)
        return meta


class CudaGraphRunner:
    """Captures ``model``'s decode forward for each bucket and replays it (see the module doc).

    ``model(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]``; logits and sampling
    stay outside the graph (their shapes and host logic vary per step).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list, num_kv_heads: int,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device | str) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.device = torch.device(device)
        self.block_size, self.max_model_len = block_size, max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self.buffers = StaticDecodeBuffers(self.buckets[-1], math.ceil(max_model_len / block_size),
                                           self.device)
        self.num_kv_heads = num_kv_heads
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}

    def num_splits(self, bucket: int) -> int:
        from memwall.kernels.triton.paged_attention import decode_splits
        return decode_splits(bucket, self.num_kv_heads, self.max_model_len, self.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all graphs in one memory pool (smaller ones reuse its blocks)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, not {self.device}")
        pool = None
        for bucket in reversed(self.buckets):
            meta = self.buffers.metadata(bucket, self.block_size, self.max_model_len,
                                         self.num_splits(bucket))
            self.buffers.pad(0, bucket)  # capture on padding only: no KV slot is written
            self._warm_up(bucket, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket, meta)
            pool = graph.pool()
            self.graphs[bucket], self.metas[bucket] = graph, meta
        torch.cuda.synchronize(self.device)

    def _warm_up(self, bucket: int, meta: AttentionMetadata) -> None:
        """Eager runs on a side stream first: Triton compiles and cuBLAS picks its kernels
        outside the capture (neither may happen inside it)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids[:bucket], b.positions[:bucket], self.kv_caches, meta)

    def can_run(self, attn: AttentionMetadata) -> bool:
        """A decode-only step that fits a captured bucket."""
        return (bool(self.graphs) and not attn.prefill_seq_ids
                and bucket_for(len(attn.decode_seq_ids), self.buckets) is not None
                and attn.block_tables.shape[1] <= self.buffers.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the bucket's graph on this step's decodes: hidden [n, hidden] (a view of the
        graph's output buffer, valid until the next replay). The graphs start from token ids:
        a later pipeline stage (``hidden``) is not captured."""
        if hidden is not None:
            raise ValueError("CUDA graphs do not run pipeline stages after the first; use "
                             "--enforce-eager with pipeline parallel on cuda")
        n = len(attn.decode_seq_ids)
        bucket = bucket_for(n, self.buckets)
        seq_lens = torch.tensor(attn.seq_lens, dtype=torch.int32).to(self.device, non_blocking=True)
        self.buffers.load(input_ids, positions, attn.slot_mapping, seq_lens, attn.block_tables, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
