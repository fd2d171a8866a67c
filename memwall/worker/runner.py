"""ModelRunner: SchedulerOutput -> forward pass -> sampler -> RunnerOutput.

    execute(sched):  rows.update(sched)          apply the step's deltas to the persistent rows
                     StepInputs.build()           vectorized gathers, one upload
                     backend.build_metadata()     the attention backend's own metadata
                     fast path or model forward   a CUDA graph / the fused CPU decode step
                     logits -> sampler            -> RunnerOutput

It owns the model, the KV cache tensors, the per-request rows and random generators; it knows
nothing of queues or stop conditions. With speculative decoding on it also verifies the
step's drafts (memwall/spec_decode/rejection.py) and proposes the next step's. A decode-only step may take a fast path: the captured
CUDA graphs on a GPU (memwall/worker/cuda_graphs.py) or the fused CPU decode step
(memwall/worker/cpu_decode.py), twins with the same ``can_run``/``run`` shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from memwall.attention import kv_quant
from memwall.attention.backend import bind as bind_attention
from memwall.attention.backend import choose as choose_attention_backend
from memwall.attention.backend import get_backend
from memwall.config import DeviceConfig, ModelArchConfig, SpeculativeConfig
from memwall.core.step import BlockTransfers, RunnerOutput, SampledToken, SchedulerOutput
from memwall.loader.model_loader import LoadedModel
from memwall.outputs import Logprob
from memwall.sample.grammar_mask import stack_bitmask
from memwall.sample.logprobs import LogprobsTensors, compute_logprobs
from memwall.sample.metadata import SamplingMetadata
from memwall.sample.sampler import Sampler, argmax_rows
from memwall.sample.seeds import position_generator
from memwall.sampling_params import SamplingParams
from memwall.spec_decode import DraftRequest, Proposer, make_proposer
from memwall.spec_decode.adaptive import DraftLengths, StepCost
from memwall.spec_decode.rejection import verify_greedy, verify_random, verify_seeded
from memwall.worker.input_batch import RequestRows, StepInputs, VerifyRows
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache


def final_rows(sched: SchedulerOutput, positions: torch.Tensor, hidden: torch.Tensor,
               out: RunnerOutput) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(request id, first position, rows of ``hidden``) for each sequence of a step: the rows
    of the positions the step made final. A prompt chunk's tokens and a decoded token are all
    final; a verified sequence's are its sampled token and the drafts it accepted (the rejected
    drafts' rows are cut off). A step's sequences are consecutive rows of the flat token axis,
    in scheduling order. The EAGLE drafter records these (``_record_features``), and so does
    benchmarks/train_eagle.py's ``FeatureTap`` while it generates the head's training data."""
    offset = 0
    for request_id, count in sched.num_scheduled_tokens.items():
        final = count
        if sched.spec_token_ids.get(request_id):
            final = 1 + len(out.accepted_drafts.get(request_id, ()))
        yield request_id, int(positions[offset]), hidden[offset:offset + final]
        offset += count


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig, plan: KVCachePlan,
                 dtype: torch.dtype, seed: int, dev: DeviceConfig, max_num_seqs: int,
                 max_model_len: int, speculative: SpeculativeConfig | None = None,
                 draft: LoadedModel | None = None, lora=None) -> None:
        """``dtype``: the KV cache's; ``draft``: the drafter of ``"method": "draft_model"``;
        ``lora``: the worker's adapters (memwall/lora/worker_lora.py), whose slots the model's
        projections read."""
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
        self.lora = lora
        self.pipe = None
        """A pipeline stage's connections (memwall/distributed/pipeline.py PipeEnds); None:
        the whole model runs here."""
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
        self.spec = speculative
        self.draft_vocab_size: int | None = None
        """The first ids an EAGLE head or draft model drafts among (the config's
        ``draft_vocab_size``, else an EAGLE head's own), None: the whole vocabulary."""
        self.proposer = (self._make_proposer(speculative, draft, plan, dtype)
                         if speculative is not None else None)
        self.draft_lengths = (self._draft_lengths(speculative, max_num_seqs)
                              if speculative is not None else None)

    def _make_proposer(self, spec: SpeculativeConfig, draft: LoadedModel | None,
                       plan: KVCachePlan, dtype: torch.dtype) -> Proposer:
        proposer = self._make_drafter(spec, draft, plan, dtype)
        if not spec.uses_lookup_first:
            return proposer
        from memwall.spec_decode.lookup_first import LookupFirstProposer
        from memwall.spec_decode.ngram import NgramProposer
        return LookupFirstProposer(NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max),
                                   proposer)

    def _make_drafter(self, spec: SpeculativeConfig, draft: LoadedModel | None,
                      plan: KVCachePlan, dtype: torch.dtype) -> Proposer:
        from memwall.spec_decode.draft_vocab import draft_head
        if spec.method == "eagle":
            from memwall.spec_decode.eagle import EagleProposer, load_eagle_head
            head = load_eagle_head(spec.model, self.arch).to(self.device)
            caches = allocate_kv_cache(head.config, plan, dtype, self.device)
            fast, four_bit = None, spec.requantize is not None and self.device.type == "cpu"
            if self.device.type == "cpu":  # int8/int4 panels, and the fused step over its layer
                from memwall.worker.cpu_decode import FusedCpuDecode
                head.quantize_for_cpu("int4" if four_bit else "int8")
                fast = FusedCpuDecode.build(head.native_view(), caches)
            self.draft_vocab_size = (spec.draft_vocab_size if spec.draft_vocab_size is not None
                                     else head.draft_vocab_size)
            return EagleProposer(head, self.model, caches, plan.block_size, self.attn_backend,
                                 draft_head(self.model, self.draft_vocab_size, four_bit), fast)
        if spec.method != "draft_model":
            return make_proposer(spec)
        if draft is None:
            raise ValueError("the draft_model method needs its model loaded (Worker.load_model)")
        from memwall.spec_decode.draft_model import DraftModelProposer
        self.draft_vocab_size = spec.draft_vocab_size
        # as many tokens of draft KV as the target's pool holds: every sequence can draft
        caches = allocate_kv_cache(draft.arch, plan, dtype, self.device)
        fast = None
        if self.device.type == "cpu":
            from memwall.worker.cpu_decode import FusedCpuDecode
            fast = FusedCpuDecode.build(draft.model, caches)
        return DraftModelProposer(draft.model, draft.arch, caches, plan.block_size,
                                  self.attn_backend, fast, draft_head(draft.model,
                                                                      spec.draft_vocab_size))

    def _draft_lengths(self, spec: SpeculativeConfig, max_num_seqs: int) -> DraftLengths:
        """Adaptive lengths weigh drafts against this machine's measured step cost (CPU; a GPU
        step's cost is not measured here, so it drafts ``num_speculative_tokens`` always)."""
        cost = draft_cost = None
        if spec.adaptive and self.device.type == "cpu":
            # Row counts timed: cost(n) is interpolated between them and extrapolated past the
            # last, so the largest step (``most``) is timed too, and 17: past 16 tokens the
            # packed panels leave their one-vpdpbusd kernel for int16 tiles, a step up in cost
            # that a slope through 12 and 16 misses (16 sequences then verified drafts at 0.89x).
            most = max_num_seqs + spec.num_speculative_tokens
            sizes = sorted({n for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 17, 24, 32) if n <= most}
                           | {most, min(most, 1 + spec.num_speculative_tokens)})
            from memwall.worker.step_shape import measure_row_costs
            cost = StepCost(measure_row_costs(self.model, tuple(sizes)))
            drafter = getattr(self.proposer, "drafting_model", None)  # a drafter's own steps
            if drafter is not None:
                draft_sizes = tuple(n for n in sizes if n <= max_num_seqs) or (1,)
                draft_cost = StepCost(measure_row_costs(drafter, draft_sizes))
        return DraftLengths(spec.num_speculative_tokens, cost, spec.adaptive, draft_cost)

    def describe(self) -> str:
        if self.device.type != "cuda":
            fused = "; decode steps fused in C" if self.fast_path is not None else ""
            amx = "; prefill matmuls on AMX (split bf16)" if self.amx else ""
            return f"attention backend {self.backend}{fused}{amx}{self._describe_spec()}"
        return (f"CUDA graphs for decode batches {self.fast_path.buckets}" if self.fast_path
                else "eager (no CUDA graphs)")

    def _describe_spec(self) -> str:
        if self.spec is None:
            return ""
        text = f"; speculative decoding: {self.spec.method}, up to {self.spec.num_speculative_tokens} drafts"
        if self.draft_vocab_size is not None:
            text += f" among the first {self.draft_vocab_size} token ids"
        if self.spec.uses_lookup_first:
            text += ", prompt lookup where it pays more"
        cost = self.draft_lengths.cost
        if cost is not None and self.draft_lengths.adaptive:
            k = self.spec.num_speculative_tokens
            text += f" (adaptive: a step of {1 + k} rows costs {cost(1 + k) / cost(1):.2f}x one row"
            draft = self.draft_lengths.draft_cost
            if draft is not None:
                text += f", a draft token {draft(1) / cost(1):.2f}x"
            text += " at start-up; then as the steps run)"
        return text

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
        if self.proposer is not None:
            gone = sched.finished_ids + sched.preempted_ids
            self.proposer.forget(gone)
            self.draft_lengths.forget(gone)
        self._apply_transfers(sched.transfers)
        out = RunnerOutput()
        if sched.is_empty:
            return out
        started = time.perf_counter()
        inputs = StepInputs.build(self.rows, sched, self.device)
        attn = self.attn_backend.build_metadata(inputs.query_lens, inputs.seq_lens,
                                                inputs.block_tables, inputs.slot_mapping,
                                                self.block_size)
        lora_active = self._prepare_lora(sched)
        pipe = self.pipe  # pipeline parallel: this stage's input and output hidden states
        incoming = pipe.receive() if pipe is not None and pipe.incoming is not None else None
        if (self.fast_path is not None and self.fast_path.can_run(attn)
                and (not lora_active or getattr(self.fast_path, "runs_lora", False))):
            hidden = self.fast_path.run(inputs.input_ids, inputs.positions, attn, incoming)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn, incoming)
        if pipe is not None and pipe.outgoing is not None:
            pipe.send(hidden)  # [T, hidden] to the next stage, which samples (or passes it on)
            return out
        logits = self.model.compute_logits(hidden[inputs.logit_token_index])  # [rows, vocab]
        if inputs.sampling_ids:
            self._sample(logits[: len(inputs.sampling_ids)], inputs.sampling_ids, sched, out)
        if inputs.verify:
            self._verify(logits, inputs.verify, sched.grammar_bitmask, out)
        for rows in inputs.prompt_rows:
            if not rows.rows:
                continue
            lp = compute_logprobs(logits[rows.rows], torch.tensor(rows.targets, device=logits.device),
                                  rows.top_k)
            out.prompt_logprobs[rows.request_id] = _logprob_dicts(lp)
        if self.proposer is not None:
            if not attn.prefill_seq_ids:  # a decode/verify step: what its rows cost, for
                self.draft_lengths.observe_step(  # the adaptive draft lengths
                    len(inputs.input_ids), time.perf_counter() - started,
                    len(sched.num_scheduled_tokens))
            if self.proposer.wants_features:
                self._record_features(sched, inputs, hidden, out)
            self._propose(sched, out)
        return out

    def _prepare_lora(self, sched: SchedulerOutput) -> bool:
        """Each token's adapter slot for this step (tokens are the requests' scheduled counts
        in batch order); True when some token uses an adapter."""
        if self.lora is None:
            return False
        states = self.rows.states
        ids: list[int] = []
        for request_id, count in sched.num_scheduled_tokens.items():
            ids.extend([states[request_id].lora_id] * count)
        self.lora.prepare(ids)
        return self.lora.slots.token_slots is not None

    def _record_features(self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor,
                         out: RunnerOutput) -> None:
        """The target's hidden states of the positions this step made final, per sequence."""
        for request_id, first, rows in final_rows(sched, inputs.positions, hidden, out):
            self.proposer.record(request_id, first, rows)

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
        if self._all_plain_greedy(request_ids, sched):
            # each row's token is its argmax: what the sampler would pick, without building its
            # metadata (0.34 ms of a 10.5 ms batch-1 step on a Cascade Lake Xeon)
            for request_id, token in zip(request_ids, argmax_rows(logits).tolist()):
                out.sampled[request_id] = SampledToken(token, None)
            return
        forks = {f.request_id: f for f in sched.forks}
        rows = [self._sampling_row(rid, forks) for rid in request_ids]
        params = [r[0] for r in rows]
        masks = sched.grammar_bitmask
        meta = SamplingMetadata.build(
            params,
            [position_generator(p.seed, r[4], self.device) for p, r in zip(params, rows)],
            [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
            stack_bitmask([masks[rid][0] if rid in masks else None for rid in request_ids])
            if masks else None,
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

    def _verify(self, logits: torch.Tensor, verify: list[VerifyRows], masks: dict,
                out: RunnerOutput) -> None:
        """Exact acceptance of each sequence's drafts (spec_decode/rejection.py). Position j of
        a sequence is sampled as if drafts 0..j-1 were already its output tokens: penalties
        count them, min_tokens' banned ids end where they would, and a structured-output
        request's grammar mask is the one after drafts 0..j-1 (``masks``, one row each)."""
        rows = [r for v in verify for r in v.rows]
        # consecutive rows (every row of a batch-1 step) as a view: an index list copies R
        # vocabulary-wide rows (0.1-0.2 ms of a two-row step on a Cascade Lake Xeon)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        raw = logits[rows[0]:rows[0] + len(rows)] if contiguous else logits[rows]  # [R, V]
        meta, gens, work = None, None, raw
        # plain greedy sequences only: the sampler's metadata would change nothing (argmaxes)
        if masks or not all(_plain_greedy(self.rows.states[v.request_id].sampling_params)
                            for v in verify):
            meta, gens = self._verify_metadata(verify, masks)
            work = self.sampler.adjusted(raw, meta)  # [R, V]
        argmax = argmax_rows(work).tolist()
        offset = 0
        for v in verify:
            drafts, p = v.draft_token_ids, self.rows.states[v.request_id].sampling_params
            span = slice(offset, offset + len(drafts) + 1)
            if p.greedy:
                accepted, token = verify_greedy(argmax[span], drafts)
            else:
                index = torch.arange(span.start, span.stop, device=work.device)
                probs = self.sampler.probabilities(work, meta, index)  # [k + 1, V]
                if p.seed is None:
                    accepted, token = verify_random(probs, drafts, None, None)
                else:  # each position's own draw: the tokens decoding without drafts gives
                    accepted, token = verify_seeded(probs, drafts, gens[span])
            tokens = drafts[:accepted] + [token]
            lps = [None] * len(tokens)
            if p.logprobs is not None:
                lp = compute_logprobs(raw[offset:offset + len(tokens)],
                                      torch.tensor(tokens, device=raw.device), p.logprobs)
                lps = [_trim_top(entry, t, p.logprobs) for entry, t in zip(_logprob_dicts(lp), tokens)]
            out.accepted_drafts[v.request_id] = [SampledToken(t, e) for t, e in zip(tokens[:-1], lps)]
            out.sampled[v.request_id] = SampledToken(token, lps[-1])
            self.draft_lengths.observe(v.request_id, len(drafts), accepted)
            offset = span.stop

    def _verify_metadata(self, verify: list[VerifyRows], masks: dict
                         ) -> tuple[SamplingMetadata, list[torch.Generator | None]]:
        """The sampler's metadata of the verified rows (one per draft position and sequence, as
        ``_verify`` says) and each row's generator (a seeded request's: its position's)."""
        params, gens, prompts, outputs, banned, mask_rows = [], [], [], [], [], []
        for v in verify:
            state = self.rows.states[v.request_id]
            p = state.sampling_params
            penalized = _has_penalties(p)  # the sampler reads token lists for nothing else
            output_ids = self.rows.output_ids(v.request_id)
            history = output_ids.tolist() if penalized else []
            prompt = self.rows.prompt_ids(v.request_id).tolist() if penalized else []
            num_out = len(output_ids)
            for j in range(len(v.draft_token_ids) + 1):
                params.append(p)
                gens.append(position_generator(p.seed, num_out + j, self.device))
                prompts.append(prompt)
                outputs.append(history + v.draft_token_ids[:j] if penalized else [])
                banned.append(_banned_ids(p, state.eos_token_ids, num_out + j))
                mask = masks.get(v.request_id)
                mask_rows.append(mask[j] if mask is not None else None)
        meta = SamplingMetadata.build(params, gens, prompts, outputs, banned,
                                      stack_bitmask(mask_rows) if masks else None)
        return meta, gens

    def _propose(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """Drafts for the next step of every held sequence that got a token, as many as pay
        (spec_decode/adaptive.py), none above disable_by_batch_size running sequences and none
        while a prompt is still being read (a sequence of this step got no token: its chunk
        was not its prompt's last, so the next step carries a prompt chunk; adaptive.py says
        why)."""
        batch = len(sched.num_scheduled_tokens)
        limit = self.spec.disable_by_batch_size
        if limit is not None and batch > limit:
            return
        reading = any(rid not in out.sampled for rid in sched.num_scheduled_tokens)
        lengths = self.draft_lengths
        if not reading and not lengths.could_draft(batch, 1.0):
            # not even drafts that are always accepted would pay at this batch (a full batch
            # on a CPU whose rows are compute-bound): no sequence is looked at, and its
            # evidence does not age while it has no chance to draft (16 sequences on a
            # Cascade Lake Xeon: 0.12-0.16 -> 0.07 ms of a step)
            lengths.end_step(False)
            return
        held = []  # (request id, its row) of the sequences that got a token
        for request_id in out.sampled:
            row = self.rows.row_of.get(request_id)
            if row is None:
                continue  # a fork child's first token: it joins the rows next step
            if request_id not in out.accepted_drafts:
                lengths.idle(request_id)
            held.append((request_id, row))
        if reading:
            return  # no drafts this step; every sequence's evidence still aged
        # where even the best estimate's free drafts would not pay (a full batch on a CPU
        # whose rows are compute-bound), no sequence drafts: skip pricing each one
        best = max((max(lengths.rate(rid, True), lengths.rate(rid, False)) for rid, _ in held),
                   default=0.0)
        if not lengths.could_draft(batch, best):
            lengths.end_step(False)
            return
        contexts = []  # (request id, all its tokens, whether its drafts would be free)
        for request_id, row in held:
            sampled = out.sampled[request_id]
            known = self.rows.token_ids[row, :self.rows.num_tokens[row]]
            new = [t.token_id for t in out.accepted_drafts.get(request_id, ())] + [sampled.token_id]
            tokens = np.concatenate([known, new])
            contexts.append((request_id, tokens, self.proposer.drafts_free(request_id, tokens)))
        # the likeliest to be accepted choose first: each prices its drafts against the rows
        # the ones before it added to the step (adaptive.py)
        contexts.sort(key=lambda c: -lengths.rate(c[0], c[2]))
        requests, drafted = [], 0
        either = self.proposer.lookup_or_model  # a lookup match may still take the model's drafts
        for request_id, tokens, free in contexts:
            kinds = (True, False) if free and either else (free,)
            k, free = lengths.choose_among(request_id, batch, drafted, kinds)
            if k == 0:
                continue
            drafted += k
            requests.append(DraftRequest(request_id, tokens, k, by_lookup=free if either else None))
        lengths.end_step(bool(requests))
        if not requests:
            return
        started = time.perf_counter()
        out.draft_token_ids = self.proposer.propose(requests)
        if all(lengths.knows(r.request_id) for r in requests):  # no prompt read
            lengths.observe_drafting(time.perf_counter() - started,
                                     self.proposer.priced_tokens(out.draft_token_ids))

    def _all_plain_greedy(self, request_ids: list[str], sched: SchedulerOutput) -> bool:
        """Whether every row samples its argmax with nothing to adjust or report (no grammar
        mask, no fork: a fork's first token has its own parameters)."""
        if sched.forks or sched.grammar_bitmask:
            return False
        states = self.rows.states
        return all(_plain_greedy(states[request_id].sampling_params) for request_id in request_ids)

    def _sampling_row(self, request_id: str, forks: dict) -> tuple:
        """(params, prompt ids, output ids, banned ids, output tokens so far: the index of the
        token it samples) of one sampling row. The token lists are built only for requests
        with penalties: the sampler reads them for nothing else."""
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
        return params, prompt_ids, output_ids, _banned_ids(params, eos, outputs), outputs


def _plain_greedy(params: SamplingParams) -> bool:
    """A request whose every token is its row's argmax, with nothing to adjust or report:
    greedy, no logprobs, no penalties, no min_tokens (whose banned ids mask EOS)."""
    return (params.greedy and params.logprobs is None and not params.min_tokens
            and not _has_penalties(params))


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _banned_ids(params: SamplingParams, eos: frozenset[int], num_outputs: int) -> list[int]:
    """EOS and stop tokens are masked until min_tokens have been generated, except for a
    structured-output request: where its grammar is complete, EOS may be all it allows."""
    if num_outputs >= params.min_tokens or params.structured_outputs is not None:
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
