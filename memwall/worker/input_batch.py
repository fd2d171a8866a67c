"""InputBatch: one step's scheduled chunks flattened into the tensors a forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.core.step import ScheduledChunk
from memwall.request import Request


@dataclass
class PromptLogprobRows:
    """Rows of the logits that score prompt tokens for one request."""

    request_id: str
    rows: list[int]  # indexes into the logits rows
    targets: list[int]  # the prompt token each row predicts
    top_k: int  # how many top candidates the request asked for


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logit_token_index: list[int]
    """Flat token index of every row of logits to compute (sampling rows first)."""
    sampling_requests: list[Request]
    """Requests that sample this step, in the order of the first logits rows (a fork child
    shares its parent's row: both are predicted by the same last prompt token)."""
    prompt_rows: list[PromptLogprobRows]

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], block_size: int,
              device: torch.device | str = "cpu", backend: str = "torch") -> "InputBatch":
        """Tensors on ``device``; ``backend`` names the attention backend (memwall/attention/backend.py)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_index: list[int] = []
        sampling_requests: list[Request] = []
        prompt_tokens: list[tuple[str, list[int], list[int], int]] = []
        for chunk in chunks:
            offset = len(ids)
            ids.extend(chunk.request.token_slice(chunk.start, chunk.end))
            positions.extend(range(chunk.start, chunk.end))
            if chunk.samples:
                for request in [chunk.request, *chunk.forks]:
                    sample_index.append(len(ids) - 1)
                    sampling_requests.append(request)
            if chunk.request.wants_prompt_logprobs:
                prompt_tokens.append(_prompt_logprob_positions(chunk, offset))
        logit_index = list(sample_index)
        prompt_rows = []
        for request_id, flat, targets, top_k in prompt_tokens:
            rows = list(range(len(logit_index), len(logit_index) + len(flat)))
            logit_index.extend(flat)
            prompt_rows.append(PromptLogprobRows(request_id, rows, targets, top_k))
        attn = AttentionMetadata.build([c.num_tokens for c in chunks], [c.end for c in chunks],
                                       [c.block_table for c in chunks], block_size, device, backend)
        return cls(torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(positions, dtype=torch.long, device=device),
                   attn, logit_index, sampling_requests, prompt_rows)


def _prompt_logprob_positions(chunk: ScheduledChunk, offset: int) -> tuple[str, list[int], list[int], int]:
    """Positions p in the chunk whose next token p + 1 is a prompt token not yet scored."""
    request = chunk.request
    first = len(request.prompt_logprobs)  # entries already collected (position 0 counts as one)
    flat, targets = [], []
    for pos in range(chunk.start, chunk.end):
        if first <= pos + 1 < request.num_prompt_tokens:
            flat.append(offset + pos - chunk.start)
            targets.append(request.prompt_token_ids[pos + 1])
    return request.request_id, flat, targets, request.sampling_params.prompt_logprobs or 0
