"""ModelRunner: SchedulerOutput -> forward pass -> sampler -> RunnerOutput.

It owns the model, the KV cache tensors and the per-request random generators; it knows
nothing of queues or stop conditions. On a GPU it also owns the decode CUDA graphs
(memwall/worker/cuda_graphs.py) and a swap pool in pinned host memory.
"""

from __future__ import annotations

import torch

from memwall.config import ModelArchConfig
from memwall.core.kv.manager import BlockTransfers
from memwall.core.step import RunnerOutput, SampledToken, SchedulerOutput
from memwall.outputs import Logprob
from memwall.request import Request
from memwall.sample.logprobs import LogprobsTensors, compute_logprobs
from memwall.sample.metadata import SamplingMetadata
from memwall.sample.sampler import Sampler
from memwall.worker.input_batch import InputBatch
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, plan: KVCachePlan,
                 dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu",
                 backend: str = "torch") -> None:
        """``dtype``: the KV cache's; ``backend``: the attention backend (torch or triton)."""
        self.model = model
        self.arch = arch
        self.block_size = plan.block_size
        self.device, self.backend = torch.device(device), backend
        self.kv_caches = allocate_kv_cache(arch, plan, dtype, self.device)
        # The secondary pool for swap preemption: host memory (on CPU, simply other tensors;
        # pinned on a GPU, so block copies run asynchronously on the compute stream).
        self.swap_caches = (allocate_kv_cache(arch, plan, dtype, "cpu", plan.num_swap_blocks,
                                              pin_memory=self.device.type == "cuda")
                            if plan.num_swap_blocks else [])
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = None  # a CudaGraphRunner once capture_cuda_graphs() ran
        torch.manual_seed(seed)  # the shared generator used by unseeded requests (every device)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        """Captures the decode forward per batch-size bucket; returns the buckets."""
        from memwall.worker.cuda_graphs import CudaGraphRunner
        if self.backend != "triton":
            raise ValueError("CUDA graphs replay the triton attention backend; this runner uses "
                             f"{self.backend!r} (run with --enforce-eager)")
        graphs = CudaGraphRunner(self.model, self.kv_caches, self.arch.num_key_value_heads,
                                 max_num_seqs, max_model_len, self.block_size, self.device)
        graphs.capture()
        self.graphs = graphs
        return graphs.buckets

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._apply_transfers(sched.transfers)
        batch = InputBatch.build(sched.chunks, self.block_size, self.device, self.backend)
        if self.graphs is not None and self.graphs.can_run(batch.attn):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.attn)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        logits = self.model.compute_logits(hidden[batch.logit_token_index])  # [rows, vocab]
        out = RunnerOutput()
        if batch.sampling_requests:
            self._sample(logits[: len(batch.sampling_requests)], batch, out)
        for rows in batch.prompt_rows:
            if not rows.rows:
                continue
            lp = compute_logprobs(logits[rows.rows], torch.tensor(rows.targets, device=logits.device),
                                  rows.top_k)
            out.prompt_logprobs[rows.request_id] = _logprob_dicts(lp)
        return out

    def _apply_transfers(self, transfers: BlockTransfers) -> None:
        """Swap-outs read blocks before swap-ins and copies may overwrite them: order matters."""
        if not transfers:
            return
        if self.device.type == "cuda":
            self._apply_transfers_async(transfers)
            return
        moves = [(self.kv_caches, self.swap_caches, transfers.swap_out),
                 (self.swap_caches, self.kv_caches, transfers.swap_in),
                 (self.kv_caches, self.kv_caches, transfers.copies)]
        for source, target, pairs in moves:
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs])
            dst = torch.tensor([b for _, b in pairs])
            for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
                dst_k[dst] = src_k[src].to(dst_k.device)
                dst_v[dst] = src_v[src].to(dst_v.device)

    def _apply_transfers_async(self, transfers: BlockTransfers) -> None:
        """GPU: one asynchronous copy per block and layer, queued on the compute stream.

        A block is contiguous in both pools ([block_size, kv_heads, head_dim]) and the swap pool
        is pinned, so every copy is a DMA that the host does not wait for. Stream order keeps it
        correct: a swapped-out block is read before any later kernel overwrites it, and a
        swap-in lands before the forward pass that reads it.
        """
        moves = [(self.kv_caches, self.swap_caches, transfers.swap_out),
                 (self.swap_caches, self.kv_caches, transfers.swap_in),
                 (self.kv_caches, self.kv_caches, transfers.copies)]
        for source, target, pairs in moves:
            for (src_k, src_v), (dst_k, dst_v) in zip(source, target):
                for a, b in pairs:
                    dst_k[b].copy_(src_k[a], non_blocking=True)
                    dst_v[b].copy_(src_v[a], non_blocking=True)

    def _sample(self, logits: torch.Tensor, batch: InputBatch, out: RunnerOutput) -> None:
        requests = batch.sampling_requests
        meta = SamplingMetadata.build(
            [r.sampling_params for r in requests],
            [self._generator(r) for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            [_banned_ids(r) for r in requests],
        )
        result = self.sampler(logits, meta)
        tokens = result.sampled_token_ids.tolist()
        dicts = _logprob_dicts(result.logprobs) if result.logprobs is not None else [None] * len(tokens)
        for request, token, lp in zip(requests, tokens, dicts):
            if request.sampling_params.logprobs is None:
                lp = None
            elif lp is not None:
                lp = _trim_top(lp, token, request.sampling_params.logprobs)
            out.sampled[request.request_id] = SampledToken(token, lp)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)  # draws where the logits are
            self._generators[request.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forgets per-request state once a request is finished."""
        self._generators.pop(request_id, None)


def _banned_ids(request: Request) -> list[int]:
    """EOS and stop tokens are masked until min_tokens have been generated."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(request.eos_token_ids)
    return banned


def _logprob_dicts(lp: LogprobsTensors) -> list[dict[int, Logprob]]:
    """Row i -> {token id: Logprob}: the row's own token first, then its top-k."""
    ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    rows = []
    for row_ids, row_values, rank in zip(ids, values, ranks):
        entry = {row_ids[0]: Logprob(row_values[0], rank)}
        for i, (tid, value) in enumerate(zip(row_ids[1:], row_values[1:])):
            entry.setdefault(tid, Logprob(value, i + 1))
        rows.append(entry)
    return rows


def _trim_top(entry: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """The batch computes max(k) top entries; keep this request's k (plus its sampled token)."""
    return {tid: lp for tid, lp in entry.items() if tid == token or (lp.rank or 0) <= k}
