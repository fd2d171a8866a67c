"""Drafts from a smaller model with the target's tokenizer (vLLM's ``"method": "draft_model"``).

Each step the drafter brings its own KV cache up to every drafting sequence's tokens, then
decodes k tokens greedily, all sequences in one batch per position:

    known tokens  t0 .. tn-1 | new: accepted drafts + the sampled token
    draft cache   t0 .. tc-1 | rolled back to the longest prefix it shares with the sequence
    forward 1     the tokens past tc (a prefill chunk; one token in the steady state) -> d1
    forward 2..k  d1, d2, ... one token each (the fused CPU decode step where it can)  -> d2..dk

The drafts are greedy, so rejection sampling treats them as a deterministic proposal
(rejection.verify_random with no draft probabilities): exact for any target temperature.

The draft cache is paged like the target's, in blocks of its own pool, kept per sequence
until ``forget``; a sequence whose blocks do not fit gets no draft that step (the target never
waits for the drafter, and nothing is evicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from memwall.attention.backend import AttentionBackend, bind as bind_attention
from memwall.config import ModelArchConfig
from memwall.spec_decode.proposer import DraftRequest, Proposer


class DraftModelError(ValueError):
    """The draft model cannot serve this target (one line, for users)."""


def check_tokenizers(target, draft, draft_name: str) -> None:
    """Drafts are token ids of the target's vocabulary: the two tokenizers must agree on every
    token (``target``, ``draft``: memwall Tokenizers)."""
    if target.vocab_size != draft.vocab_size:
        raise DraftModelError(f"draft model {draft_name} has a {draft.vocab_size}-token vocabulary, "
                              f"the target {target.vocab_size}: a draft model needs the target's "
                              "tokenizer")
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise DraftModelError(f"draft model {draft_name}'s tokenizer maps tokens to other ids than "
                              "the target's: a draft model needs the target's tokenizer")


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)
    """The tokens whose K/V are in the draft cache, in order."""
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 backend: AttentionBackend, fast_path=None) -> None:
        """``kv_caches``: the drafter's own pool (worker/kv_cache.allocate_kv_cache);
        ``fast_path``: a FusedCpuDecode over it for the one-token forwards, or None."""
        self.model, self.arch, self.kv_caches = model, arch, kv_caches
        self.block_size, self.backend, self.fast_path = block_size, backend, fast_path
        bind_attention(model, backend)
        self.max_len = arch.max_position_embeddings
        self.free = list(range(kv_caches[0][0].shape[0] - 1, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        self.device = kv_caches[0][0].device

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def drafting_model(self) -> torch.nn.Module:
        """What one drafted token runs (timed at start-up for the adaptive draft lengths)."""
        return self.model

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.seqs.pop(request_id, None)
            if seq is not None:
                self.free.extend(reversed(seq.blocks))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        active: list[tuple[DraftRequest, _DraftSeq, list[int]]] = []
        for req in requests:
            seq = self.seqs.setdefault(req.request_id, _DraftSeq())
            known = req.token_ids.tolist()
            k = min(req.max_drafts, self.max_len - len(known))
            if k < 1 or not self._reserve(seq, len(known) + k - 1):
                continue
            shared = _common_prefix(seq.tokens, known)
            if shared == len(known):  # the cache holds every token: its last one is fed again
                shared -= 1           # (same slot, same K/V) for the logits of the next
            seq.tokens = known[:shared]
            active.append((req, seq, known[shared:]))
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in active}
        step_inputs = [new for _, _, new in active]
        limits = [min(req.max_drafts, self.max_len - len(req.token_ids)) for req, _, _ in active]
        for position in range(max(limits, default=0)):
            rows = [i for i, limit in enumerate(limits) if position < limit]
            if not rows:
                break
            next_ids = self._forward([active[i][1] for i in rows], [step_inputs[i] for i in rows])
            for i, token in zip(rows, next_ids):
                drafts[active[i][0].request_id].append(token)
                step_inputs[i] = [token]
        return drafts

    def _reserve(self, seq: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` K/V rows; False (the sequence's cache dropped, its blocks
        freed) when the pool has too few."""
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self.free):
            self.free.extend(reversed(seq.blocks))
            seq.blocks, seq.tokens = [], []
            return False
        seq.blocks.extend(self.free.pop() for _ in range(need))
        return True

    def _forward(self, seqs: list[_DraftSeq], inputs: list[list[int]]) -> list[int]:
        """Feeds each sequence its new tokens (appending them to its cache) and returns the
        greedy next token of each."""
        bs = self.block_size
        query_lens = np.array([len(t) for t in inputs], dtype=np.int64)
        seq_lens = np.array([len(s.tokens) + len(t) for s, t in zip(seqs, inputs)], dtype=np.int64)
        width = max(len(s.blocks) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int64)
        positions, slots = [], []
        for row, (seq, new) in enumerate(zip(seqs, inputs)):
            tables[row, :len(seq.blocks)] = seq.blocks
            for pos in range(len(seq.tokens), len(seq.tokens) + len(new)):
                positions.append(pos)
                slots.append(seq.blocks[pos // bs] * bs + pos % bs)
        dev = self.device
        input_ids = torch.tensor([t for new in inputs for t in new], dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        attn = self.backend.build_metadata(query_lens, seq_lens, torch.from_numpy(tables).to(dev),
                                           torch.tensor(slots, dtype=torch.long, device=dev), bs)
        if self.fast_path is not None and self.fast_path.can_run(attn):
            hidden = self.fast_path.run(input_ids, pos_t, attn)
        else:
            hidden = self.model(input_ids, pos_t, self.kv_caches, attn)
        last = torch.as_tensor(np.cumsum(query_lens) - 1, device=dev)
        logits = self.model.compute_logits(hidden[last])
        for seq, new in zip(seqs, inputs):
            seq.tokens.extend(new)
        return logits.argmax(dim=-1).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n and a[:n] == b[:n]:
        return n
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n
