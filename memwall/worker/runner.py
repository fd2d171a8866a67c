"""ModelRunner: SchedulerOutput -> forward pass -> sampler -> RunnerOutput.

    execute(sched):  rows.update(sched)          apply the step's deltas to the persistent rows
                     StepInputs.build()           vectorized gathers, one upload
                     backend.build_metadata()     the attention backend's own metadata
                     fast path or model forward   a CUDA graph / the fused CPU decode step
                     logits -> sampler            -> RunnerOutput

It owns the model, the KV cache tensors, the per-request rows and random generators; it knows
nothing of queues or stop conditions. A decode-only step may take a fast path: the captured
CUDA graphs on a GPU (memwall/worker/cuda_graphs.py) or the fused CPU decode step
(memwall/worker/cpu_decode.py), twins with the same ``can_run``/``run`` shape.
"""

from __future__ import annotations

import torch

from memwall.attention import kv_quant
from memwall.attention.backend import bind as bind_attention
from memwall.attention.backend import choose as choose_attention_backend
from memwall.attention.backend import get_backend
from memwall.config import DeviceConfig, ModelArchConfig
from memwall.core.step import BlockTransfers, RunnerOutput, SampledToken, SchedulerOutput
from memwall.outputs import Logprob
from memwall.sample.logprobs import LogprobsTensors, compute_logprobs
from memwall.sample.metadata import SamplingMetadata
from memwall.sample.sampler import Sampler
from memwall.sampling_params import SamplingParams
from memwall.worker.input_batch import RequestRows, StepInputs
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, plan: KVCachePlan,
                 dtype: torch.dtype, seed: int, dev: DeviceConfig, max_num_seqs: int,
                 max_model_len: int) -> None:
        """``dtype``: the KV cache's."""
        device = dev.device
        backend = choose_attention_backend(device)
        self.model = model
        self.arch = arch
        self.block_size = plan.block_size
        self.device, self.backend = torch.device(device), backend
        self.attn_backend = get_backend(backend)
        bind_attention(model, self.attn_backend)
        self.rows = RequestRows(max_num_seqs, max_model_len, plan.block_size)
        self.kv_caches = allocate_kv_cache(arch, plan, dtype, self.device)
        # The secondary pool for swap preemption: host memory (on CPU, simply other tensors;
        # pinned on a GPU, so block copies run asynchronously on the compute stream).
        self.swap_caches = (allocate_kv_cache(arch, plan, dtype, "cpu", plan.num_swap_blocks,
                                              pin_memory=self.device.type == "cuda")
                            if plan.num_swap_blocks else [])
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        torch.manual_seed(seed)  # the shared generator used by unseeded requests (every device)
        self.fast_path = None  # a CudaGraphRunner or a FusedCpuDecode: decode-only steps
        if dev.is_cuda and not dev.enforce_eager and backend == "triton":
            self.capture_cuda_graphs(max_num_seqs, max_model_len)
        elif self.device.type == "cpu":
            from memwall.worker.cpu_decode import FusedCpuDecode
            self.fast_path = FusedCpuDecode.build(model, self.kv_caches)
        # Whether prefill's quantized matmuls take AMX (kernels/cpu/amx.py): its probe runs
        # here, at start-up, instead of inside the first long prompt.
        self.amx = self.device.type == "cpu" and _amx_enabled()

    def describe(self) -> str:
        if self.device.type != "cuda":
            fused = "; decode steps fused in C" if self.fast_path is not None else ""
            amx = "; prefill matmuls on AMX (split bf16)" if self.amx else ""
            return f"attention backend {self.backend}{fused}{amx}"
        return (f"CUDA graphs for decode batches {self.fast_path.buckets}" if self.fast_path
                else "eager (no CUDA graphs)")

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> list[int]:
        """Captures the decode forward per batch-size bucket; returns the buckets."""
        from memwall.worker.cuda_graphs import CudaGraphRunner
        if self.backend != "triton":
            raise ValueError("CUDA graphs replay the triton attention backend; this runner uses "
                             f"{self.backend!r} (run with --enforce-eager)")
        graphs = CudaGraphRunner(self.model, self.kv_caches, self.arch.num_key_value_heads,
                                 max_num_seqs, max_model_len, self.block_size, self.device)
        graphs.capture()
        self.fast_path = graphs
        return graphs.buckets

    @property
    def graphs(self):
        """The CUDA graphs, when that is the fast path."""
        from memwall.worker.cuda_graphs import CudaGraphRunner
        return self.fast_path if isinstance(self.fast_path, CudaGraphRunner) else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.rows.update(sched)
        for request_id in sched.finished_ids:
            self._generators.pop(request_id, None)
        self._apply_transfers(sched.transfers)
        out = RunnerOutput()
        if sched.is_empty:
            return out
        inputs = StepInputs.build(self.rows, sched, self.device)
        attn = self.attn_backend.build_metadata(inputs.query_lens, inputs.seq_lens,
                                                inputs.block_tables, inputs.slot_mapping,
                                                self.block_size)
        if self.fast_path is not None and self.fast_path.can_run(attn):
            hidden = self.fast_path.run(inputs.input_ids, inputs.positions, attn)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn)
        logits = self.model.compute_logits(hidden[inputs.logit_token_index])  # [rows, vocab]
        if inputs.sampling_ids:
            self._sample(logits[: len(inputs.sampling_ids)], inputs.sampling_ids, sched, out)
        for rows in inputs.prompt_rows:
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
            for (src_k, src_v), (dst_k, dst_v) in zip(source, target):  # int8: scales too
                kv_quant.copy_blocks(src_k, dst_k, src, dst)
                kv_quant.copy_blocks(src_v, dst_v, src, dst)

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

    def _sample(self, logits: torch.Tensor, request_ids: list[str], sched: SchedulerOutput,
                out: RunnerOutput) -> None:
        forks = {f.request_id: f for f in sched.forks}
        rows = [self._sampling_row(rid, forks) for rid in request_ids]
        params = [r[0] for r in rows]
        meta = SamplingMetadata.build(
            params,
            [self._generator(rid, p) for rid, p in zip(request_ids, params)],
            [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
        )
        result = self.sampler(logits, meta)
        tokens = result.sampled_token_ids.tolist()
        dicts = _logprob_dicts(result.logprobs) if result.logprobs is not None else [None] * len(tokens)
        for request_id, p, token, lp in zip(request_ids, params, tokens, dicts):
            if p.logprobs is None:
                lp = None
            elif lp is not None:
                lp = _trim_top(lp, token, p.logprobs)
            out.sampled[request_id] = SampledToken(token, lp)

    def _sampling_row(self, request_id: str, forks: dict) -> tuple:
        """(params, prompt ids, output ids, banned ids) of one sampling row. The token lists
        are built only for requests with penalties: the sampler reads them for nothing else."""
        fork = forks.get(request_id)
        if fork is not None:  # a pending sample's first token: its parent's tokens, no outputs
            params, eos, outputs = fork.sampling_params, fork.eos_token_ids, 0
            source = fork.parent_id
        else:
            state = self.rows.states[request_id]
            params, eos, source = state.sampling_params, state.eos_token_ids, request_id
            outputs = len(self.rows.output_ids(request_id))
        prompt_ids: list[int] = []
        output_ids: list[int] = []
        if _has_penalties(params):
            prompt_ids = self.rows.prompt_ids(source).tolist()
            output_ids = self.rows.output_ids(source).tolist() if fork is None else []
        return params, prompt_ids, output_ids, _banned_ids(params, eos, outputs)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        seed = params.seed
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)  # draws where the logits are
            self._generators[request_id] = gen
        return gen


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _banned_ids(params: SamplingParams, eos: frozenset[int], num_outputs: int) -> list[int]:
    """EOS and stop tokens are masked until min_tokens have been generated."""
    if num_outputs >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(eos)
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


def _amx_enabled() -> bool:
    from memwall.kernels.cpu import amx, build
    return build.available() and amx.enabled()
