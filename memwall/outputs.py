"""What the engine hands back to users: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One candidate token at one position: its log-probability and rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k candidates).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    """None while running; then "stop" (EOS, stop string or stop token), "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, if any."""
    delta_text: str = ""
    """Text added since the previous RequestOutput for this request (for streaming)."""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request, in time.monotonic() seconds (None: not yet)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    """The first engine step that ran some of its tokens."""
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified for this request (all its samples)."""
    num_accepted_tokens: int = 0
    """Of those, accepted."""
    num_verify_steps: int = 0
    """Steps that verified drafts for it."""

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens a verifying step yielded on average (accepted drafts + the sampled one)."""
        if not self.num_verify_steps:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
