"""The one contract between the scheduler (core) and the workers: plain, picklable data.

``SchedulerOutput`` says, for one engine step, which tokens of which requests to run. A worker
keeps its own per-request state (memwall/worker/input_batch.py), so a request's data crosses
once and then only its deltas do:

    step 1   new_requests:    [NewRequestData(a: prompt ids, params, blocks [7, 8])]
    step 2   cached_requests: [CachedRequestData(a: new tokens [t1], new blocks [])]
    step 9   cached_requests: [CachedRequestData(a: new tokens [t8], new blocks [9])]
    step 12  finished_ids:    [a]                                   (the worker forgets a)

A request that was preempted, or whose block table was rewritten (copy on write), is sent whole
again. The worker answers with ``RunnerOutput``: the token sampled for every request whose
scheduled tokens reached the end of its known tokens, plus logprobs where asked.

Speculative decoding adds two things. The worker proposes draft tokens with its answer
(``RunnerOutput.draft_token_ids``); the scheduler may schedule them the next step after the
sequence's last token (``SchedulerOutput.spec_token_ids``), and the worker answers with the
drafts it accepted (``accepted_drafts``) before the token it sampled after them:

    step 5   num_scheduled_tokens {a: 4}   spec_token_ids {a: [d1, d2, d3]}   (t5 d1 d2 d3)
             -> accepted_drafts {a: [d1, d2]}, sampled {a: t8}: a gains d1 d2 t8, and KV
                slots of d3 are simply overwritten later (blocks only d3 filled are freed)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memwall.sampling_params import SamplingParams


@dataclass(frozen=True)
class BlockTransfers:
    """Copies for the worker, applied in this order before the forward pass."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)


@dataclass(frozen=True)
class NewRequestData:
    """Everything the worker needs about a request it does not hold (new, or resumed)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption; empty for a new request."""
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (a prefix-cache hit, or swapped back in)."""
    num_prompt_logprobs_done: int = 0
    """Prompt positions already scored (they are computed once, even across preemptions)."""
    lora_id: int = 0
    """The LoRA adapter (lora_int_id) its tokens run through; 0: none."""


@dataclass(frozen=True)
class CachedRequestData:
    """What changed for a request the worker already holds."""

    request_id: str
    new_token_ids: list[int]
    """Tokens appended since the worker last saw it (the token sampled last step)."""
    new_block_ids: list[int]
    num_computed_tokens: int
    num_blocks: int = -1
    """The block table's length after this update (new_block_ids are its tail): a table may
    shrink when rejected draft tokens give back blocks. -1: it only grew."""


@dataclass(frozen=True)
class ForkData:
    """n > 1: a pending sample that takes its first token from its parent's last logits this
    step (then it shares the parent's blocks and is sent as a new request)."""

    request_id: str
    parent_id: str
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """request id -> tokens to run this step, in batch order."""
    forks: list[ForkData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests the worker held that finished or were aborted: forget them."""
    preempted_ids: list[str] = field(default_factory=list)
    """Requests the worker held that lost their blocks: forget them until they come back new."""
    transfers: BlockTransfers = field(default_factory=BlockTransfers)
    """Block copies (swap out, swap in, copy-on-write) to apply before the forward pass."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request id -> draft tokens to verify after its last known token (they are counted in
    num_scheduled_tokens; only for requests whose other scheduled token is their last)."""
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)
    """request id -> allowed-token bitmask rows (numpy int32 [1 + drafts, ceil(vocab / 32)])
    for structured-output requests that sample this step: the next token's row, then one per
    draft position (memwall/structured/)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict | None = None
    """token id -> memwall.outputs.Logprob for the sampled token and the top-k, when asked."""


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    """request_id -> the token sampled this step (requests that reached their last token)."""
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    """request_id -> logprob dicts for the prompt positions this step predicted."""
    accepted_drafts: dict[str, list[SampledToken]] = field(default_factory=dict)
    """request_id -> the draft tokens verification accepted; they come before ``sampled``."""
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request_id -> draft tokens proposed for its next step (after ``sampled``)."""
