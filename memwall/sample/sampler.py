"""Sampler: one step's logits -> sampled token ids (+ logprobs of the raw logits).

Pipeline: logprobs (raw logits) -> grammar mask -> banned tokens -> penalties -> greedy rows take argmax ->
random rows: temperature, top-k, top-p, min-p, then an exponential race per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from memwall.sample.grammar_mask import apply_token_bitmask
from memwall.sample.logprobs import LogprobsTensors, compute_logprobs
from memwall.sample.metadata import SamplingMetadata
from memwall.sample.penalties import apply_banned_tokens, apply_penalties


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when max_num_logprobs is None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [B, V], through numpy for contiguous float32 CPU tensors: torch
    2.13's CPU argmax took 680 us over Gemma 3's 262,144 logits and 3.2 ms over 16 rows of
    Qwen2.5's 151,936, numpy's 39 us and 0.56 ms (AMD EPYC Zen 3) -- 2.6% of a Gemma 3 270M
    decode step. Same answers: the first maximal index, and a NaN counts as the maximum."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        work = self.adjusted(logits, meta)  # [B, V]
        sampled = self._sample(work, meta)  # [B]
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def adjusted(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A float32 copy with the grammar mask, banned tokens and penalties applied (the caller's logits stay
        raw for the logprobs). Greedy rows take its argmax. Nothing to apply: the float32 logits
        themselves, which no caller writes to (copying Gemma 3's 262,144 fresh floats a step took
        0.27 ms of a 22 ms decode step)."""
        untouched = (meta.token_bitmask is None and meta.no_penalties
                     and not any(meta.banned_token_ids))
        if untouched and logits.dtype == torch.float32:
            return logits
        work = logits.to(torch.float32, copy=True)  # [B, V]
        if meta.token_bitmask is not None:
            apply_token_bitmask(work, meta.token_bitmask)
        apply_banned_tokens(work, meta.banned_token_ids)
        if not meta.no_penalties:
            apply_penalties(work, meta)
        return work

    @staticmethod
    def probabilities(work: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The distribution random rows ``rows`` sample from: ``adjusted`` logits through
        temperature, top-k, top-p and min-p, then softmax. [R, V]"""
        device = work.device
        temperature = meta.temperature.to(device)[rows]  # [R]
        random_logits = work[rows] / temperature[:, None]  # [R, V]
        top_k, top_p = meta.top_k.to(device)[rows], meta.top_p.to(device)[rows]  # [R], [R]
        random_logits = apply_top_k_top_p(random_logits, top_k, top_p)
        random_logits = apply_min_p(random_logits, meta.min_p.to(device)[rows])
        return torch.softmax(random_logits, dim=-1)  # [R, V]

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # torch.argmax returns the first maximal index, so ties break towards the lower id.
        if meta.all_greedy:
            return argmax_rows(logits)  # [B]
        rows = (meta.temperature.to(logits.device) > 0).nonzero().flatten()  # [R] the random rows
        sampled = argmax_rows(logits)  # [B]; random rows are overwritten below
        probs = self.probabilities(logits, meta, rows)  # [R, V]
        sampled[rows] = exponential_race(probs, [meta.generators[i] for i in rows.tolist()])  # [R]
        return sampled


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside the top k, then outside the nucleus of the top-k distribution
    (the smallest set of most likely tokens whose probability sums to >= p). One sort serves both."""
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [R, V], [R, V]
    if use_k:
        # k = 0 (off) or k >= V reads position 0, the minimum: nothing is strictly below it.
        kth = (vocab - top_k.clamp(min=0, max=vocab)) % vocab  # [R]
        threshold = ascending.gather(1, kth[:, None])  # [R, 1]
        # Ties with the k-th value are kept (same as vLLM/HF): the cut is by value, not position.
        ascending = ascending.masked_fill(ascending < threshold, float("-inf"))  # [R, V]
    if use_p:
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)  # [R, V]
        # Drop a token if everything at or below it sums to <= 1 - p: the rest still reaches p.
        drop = cumulative <= (1.0 - top_p)[:, None]  # [R, V]
        drop[:, -1] = False  # the most likely token always survives
        ascending = ascending.masked_fill(drop, float("-inf"))  # [R, V]
    return torch.empty_like(logits).scatter_(1, order, ascending)  # [R, V] back in vocab order


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's. The ratio
    p_i / p_max is unchanged by renormalisation, so this may follow top-k/top-p."""
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))  # [R, V]


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i with probability probs[i]
    (the Gumbel-max trick in another guise), without a CDF search.

    A row with its own generator draws exactly V numbers from it and nothing else, so a seeded
    request gets the same tokens whatever shares its batch. Unseeded rows share one batched draw.
    """
    q = torch.empty_like(probs)  # [R, V]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            # Draw on the generator's own device so a CPU generator works for GPU logits too.
            q[i] = torch.empty(probs.shape[-1], device=g.device).exponential_(generator=g).to(probs.device)
    # q == 0 is possible in principle; a tiny floor keeps 0/0 from turning into NaN.
    return argmax_rows(probs / q.clamp_(min=1e-30))  # [R]
