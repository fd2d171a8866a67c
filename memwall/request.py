"""Request: the engine's mutable record of one sequence being generated.

A request with ``n > 1`` is fanned out into n of these by the engine; each is scheduled on its own.
Everything the scheduler needs is here: the tokens known so far, how many of them already have KV
in the cache (``num_computed_tokens``), and the status.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from memwall.sampling_params import SamplingParams


class GrammarState(Protocol):
    """What the scheduler asks of a structured-output request's grammar (memwall/structured/
    implements it; the core only calls it)."""

    def accept(self, token_ids: list[int]) -> bool:
        """Advances over tokens the step produced; False if the grammar refuses one."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading draft tokens the grammar allows from here (state unchanged)."""

    def bitmask(self, draft_token_ids: list[int]) -> Any:
        """Allowed-token bitmask rows [1 + drafts, ceil(vocab / 32)] int32: the row for the
        next token, then for the token after each draft (state unchanged)."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the request is done)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FORK_PENDING = "fork_pending"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved output budget: min(params.max_tokens, context window - prompt length)."""
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens (prompt then output) whose KV is in the cache."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Filled by the runner as results come back (indexes match output_token_ids).
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    """One entry per prompt position (position 0 has none: it is not predicted)."""
    first_scheduled_time: float | None = None
    """When a step first ran some of its tokens."""
    num_output_tokens_sent: int = 0
    """Output tokens already reported to the API side (EngineCoreOutput)."""
    num_prompt_logprobs_sent: int = 0
    worker_num_tokens: int = 0
    """Tokens the workers hold for this request (0: they do not hold it; see core/step.py)."""
    worker_num_blocks: int = 0
    """Block ids the workers hold for it."""
    cache_extra_keys: tuple = ()
    """Extra namespace for prefix-cache hashes (e.g. a LoRA adapter id or a cache salt)."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at (latest) admission."""
    fork_children: list["Request"] = field(default_factory=list)
    """For n > 1: the other samples, forked from this one when its prompt is done."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of this request's full blocks of known tokens (grown by the KV manager)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens the worker proposed for the next step (speculative decoding)."""
    num_draft_tokens: int = 0
    """Draft tokens verified for this request so far."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""
    num_verify_steps: int = 0
    """Steps that verified drafts for this request."""
    grammar: GrammarState | None = None
    """Structured output: the compiled grammar's state, advanced with every output token."""
    lora_id: int = 0
    """The LoRA adapter it runs with (its lora_int_id); 0: the base model."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes prompt logprobs (they are computed once, even if the request is preempted)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def tokens_from(self, start: int) -> list[int]:
        """Known tokens from position ``start`` on (without copying the whole sequence)."""
        prompt_len = self.num_prompt_tokens
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:]
        return self.prompt_token_ids[start:] + self.output_token_ids
