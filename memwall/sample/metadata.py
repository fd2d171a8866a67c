"""SamplingMetadata: the batch's sampling parameters as [B] tensors, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memwall.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step. Row i = one sequence position being sampled."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 = off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]
    """Per-row generator for seeded requests; None = the shared default generator."""
    prompt_token_ids: list[list[int]]
    """For the repetition penalty, which covers prompt + output tokens (like vLLM/HF)."""
    output_token_ids: list[list[int]]
    """For all three penalties (presence/frequency count output tokens only, as OpenAI defines)."""
    banned_token_ids: list[list[int]]
    """Ids masked to -inf for that row this step (EOS + stop ids while below min_tokens)."""
    max_num_logprobs: int | None
    """None: no logprobs this step; k >= 0: the sampled token's logprob plus the top k."""
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    token_bitmask: torch.Tensor | None = None
    """[B, ceil(V / 32)] int32 allowed-token bits of structured-output rows (-1 rows: no
    constraint); None when no row has one (memwall/sample/grammar_mask.py)."""

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        banned_token_ids: list[list[int]],
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        lengths = {len(params), len(generators), len(prompt_token_ids), len(output_token_ids),
                   len(banned_token_ids)}
        if len(lengths) != 1:
            raise ValueError(f"SamplingMetadata.build: per-row lists differ in length: {sorted(lengths)}")
        greedy = [p.greedy for p in params]
        no_penalties = all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                           and p.frequency_penalty == 0.0 for p in params)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        # One [6, B] table for the per-row floats, its rows the fields (a torch.tensor call costs
        # ~10 us here, and a decode step builds this metadata every time).
        floats = torch.tensor([[0.0 if g else p.temperature for p, g in zip(params, greedy)],
                               [p.top_p for p in params], [p.min_p for p in params],
                               [p.repetition_penalty for p in params],
                               [p.presence_penalty for p in params],
                               [p.frequency_penalty for p in params]],
                              dtype=torch.float32).reshape(6, len(params))  # [6, B]
        return cls(
            # Greedy rows store 0 even for a tiny positive temperature, so "0 = greedy" holds.
            temperature=floats[0],
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),  # [B]
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            generators=list(generators),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            token_bitmask=token_bitmask,
        )

