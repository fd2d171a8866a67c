"""The one contract between the scheduler (core) and the model runner (worker).

``SchedulerOutput`` says, for one engine step, which tokens of which requests to run; the
runner answers with ``RunnerOutput``: the sampled token of every request whose scheduled chunk
reached the end of its known tokens, plus logprobs where asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memwall.core.kv.manager import BlockTransfers
from memwall.request import Request


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of ``request`` get their KV computed this step."""

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    forks: list[Request] = field(default_factory=list)
    """Pending samples (n > 1) that sample their first token from this chunk's last logits."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so the step yields a new token."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    transfers: BlockTransfers = field(default_factory=BlockTransfers)
    """Block copies (swap out, swap in, copy-on-write) to apply before the forward pass."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict | None = None
    """token id -> memwall.outputs.Logprob for the sampled token and the top-k, when asked."""


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    """request_id -> the token sampled this step (only for chunks with ``samples``)."""
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    """request_id -> logprob dicts for the prompt positions this chunk predicted."""
