"""Drafts from a smaller model with the target's tokenizer (vLLM's ``"method": "draft_model"``).

Each step the drafter brings its own KV cache up to every drafting sequence's tokens, then
decodes k tokens greedily, all sequences in one batch per position:

    known tokens  t0 .. tn-1 | new: accepted drafts + the sampled token
    draft cache   t0 .. tc-1 | rolled back to the longest prefix it shares with the sequence
    forward 1     the tokens past tc (a prefill chunk; one token in the steady state) -> d1
    forward 2..k  d1, d2, ... one token each (the fused CPU decode step where it can)  -> d2..dk

The drafts are greedy, so rejection sampling treats them as a deterministic proposal
(rejection.verify_random with no draft probabilities): exact for any target temperature.

The draft cache is paged like the target's, in blocks of its own pool (draft_cache.py), kept
per sequence until ``forget``. With ``draft_vocab_size`` the drafter's LM head computes only the
first ids' rows (draft_vocab.py): for the 0.5B Qwen drafter, most of a drafted token's cost.
"""

from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace

import numpy as np
import torch

from memwall.attention.backend import AttentionBackend, bind as bind_attention
from memwall.config import ModelArchConfig
from memwall.sample.sampler import argmax_rows
from memwall.spec_decode.draft_cache import DraftCache
from memwall.spec_decode.proposer import DraftRequest, Proposer


ROWS_AS_DECODE = 17
"""Most new tokens of a sequence a drafter step feeds as one-token rows (1 + the most drafts a
step verifies, as the native attention's runs); more (a prompt) go the prefill way."""


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


class DraftModelProposer(Proposer):
    def __init__(self, model: torch.nn.Module, arch: ModelArchConfig,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 backend: AttentionBackend, fast_path=None, logits=None) -> None:
        """``kv_caches``: the drafter's own pool (worker/kv_cache.allocate_kv_cache);
        ``fast_path``: a FusedCpuDecode over it for the one-token forwards, or None;
        ``logits``: hidden states -> the logits drafts are the argmax of (default: the model's
        whole head; draft_vocab.draft_head for a reduced vocabulary)."""
        self.model, self.arch, self.backend, self.fast_path = model, arch, backend, fast_path
        self.logits = logits if logits is not None else model.compute_logits
        self.cache = DraftCache(kv_caches, block_size)
        bind_attention(model, backend)
        self.max_len = arch.max_position_embeddings
        self.tokens: dict[str, list[int]] = {}
        """Per sequence, the tokens whose K/V are in the draft cache, in order."""

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def drafting_model(self) -> SimpleNamespace:
        """What one drafted token runs (timed at start-up for the adaptive draft lengths): the
        model's layers and the head drafts are read from."""
        return SimpleNamespace(model=self.model.model, config=self.model.config,
                               lm_head=self.logits, compute_logits=self.logits)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.tokens.pop(request_id, None)
            self.cache.release(request_id)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        active: list[tuple[str, list[int]]] = []  # request id, tokens to feed first
        limits: list[int] = []
        for req in requests:
            rid, known = req.request_id, req.token_ids.tolist()
            k = min(req.max_drafts, self.max_len - len(known))
            if k < 1:
                continue
            if not self.cache.reserve(rid, len(known) + k - 1):
                self.tokens.pop(rid, None)  # its blocks went back to the pool
                continue
            cached = self.tokens.setdefault(rid, [])
            shared = _common_prefix(cached, known)
            if shared == len(known):  # the cache holds every token: its last one is fed again
                shared -= 1           # (same slot, same K/V) for the logits of the next
            del cached[shared:]
            active.append((rid, known[shared:]))
            limits.append(k)
        drafts: dict[str, list[int]] = {rid: [] for rid, _ in active}
        step_inputs = [new for _, new in active]
        for position in range(max(limits, default=0)):
            rows = [i for i, limit in enumerate(limits) if position < limit]
            next_ids = self._forward([active[i][0] for i in rows], [step_inputs[i] for i in rows])
            for i, token in zip(rows, next_ids):
                drafts[active[i][0]].append(token)
                step_inputs[i] = [token]
        return drafts

    def _forward(self, request_ids: list[str], inputs: list[list[int]]) -> list[int]:
        """Feeds each sequence its new tokens (appending them to its cache) and returns the
        greedy next token of each."""
        spans = [(rid, len(self.tokens[rid]), len(new)) for rid, new in zip(request_ids, inputs)]
        dev = self.cache.device
        input_ids = torch.tensor([t for new in inputs for t in new], dtype=torch.long, device=dev)
        positions = torch.tensor([e for _, first, count in spans for e in range(first, first + count)],
                                 dtype=torch.long, device=dev)
        # a few tokens a sequence (its last draft and the sampled token, after a verify that
        # accepted every draft) as one-token rows: the fused decode step, not the model's forward
        if (self.fast_path is not None and self.fast_path.use_native_decode
                and max(len(new) for new in inputs) <= ROWS_AS_DECODE):
            hidden = self.fast_path.run_rows(input_ids, positions, *self.cache.rows(spans))
        else:
            attn = self.cache.metadata(self.backend, spans)
            hidden = self.model(input_ids, positions, self.cache.kv_caches, attn)
        last = torch.tensor(list(accumulate(len(new) for new in inputs)), device=dev) - 1
        logits = self.logits(hidden[last])
        for rid, new in zip(request_ids, inputs):
            self.tokens[rid].extend(new)
        return argmax_rows(logits).tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n and a[:n] == b[:n]:
        return n
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if len(mismatch) else n
