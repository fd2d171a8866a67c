"""What crosses between the API side (tokenize, detokenize, stream) and the engine core
(schedule, run): plain, picklable data, so the core can live in another process.

    API side                                   engine core
    ────────                                   ───────────
    Processor -> EngineCoreRequest ──────────> add_request()
    abort (client left, stop string) ────────> abort_requests()
    OutputProcessor <── EngineCoreOutputs ──── step()

One ``EngineCoreRequest`` per sample: a request with ``n > 1`` arrives as n of them, the first
one carrying the others' ids in ``fork_ids`` (they share its prefill and fork its KV blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memwall.config import ModelArchConfig
from memwall.core.live_trace import TraceUpdate
from memwall.lora.request import LoRARequest
from memwall.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    """Resolved output budget: min(params.max_tokens, context window - prompt length)."""
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    """time.monotonic() on the API side (CLOCK_MONOTONIC is shared by all processes)."""
    cache_extra_keys: tuple = ()
    """Extra namespace for prefix-cache hashes (e.g. a LoRA adapter id or a cache salt)."""
    lora_request: LoRARequest | None = None
    """The adapter this sample runs with (memwall/lora/); None: the base model."""


@dataclass
class EngineCoreOutput:
    """What happened to one sample in one step. Lists hold only what is new since the last one."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list | None = None
    """One {token id: Logprob} per new token, when the request asked for logprobs."""
    new_prompt_logprobs: list | None = None
    """Prompt positions scored this step (the first entry of all is None: position 0)."""
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" once finished."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    spec_counts: tuple[int, int, int] = (0, 0, 0)
    """Speculative decoding so far: (draft tokens verified, accepted, verify steps)."""
    """Prompt tokens whose KV came from the prefix cache (at the latest admission)."""
    first_scheduled_time: float | None = None
    """When the request first got a step (sent once, on its first output)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine core after a step (for metrics and health)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Prompt tokens found there (their prefill was skipped)."""
    prefix_cache_evictions: int = 0
    """Cached blocks evicted to make room."""
    spec_num_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified so far."""
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    """Sequence-steps that verified drafts."""
    lora: "LoRAStatsSnapshot | None" = None
    """Multi-LoRA counters (None: LoRA is off)."""

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average (accepted drafts + the sampled one)."""
        if not self.spec_num_verify_steps:
            return 0.0
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_verify_steps

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0.0 .. 1.0."""
        if not self.num_total_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True)
class AdapterCounters:
    name: str
    requests: int = 0
    loads: int = 0
    """Times read from disk into the workers' host caches."""
    prefix_queries: int = 0
    """Prompt tokens of its requests looked up in the prefix cache ..."""
    prefix_hits: int = 0
    """... and found there."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True)
class LoRAStatsSnapshot:
    loads: int = 0
    evictions: int = 0
    """Adapters dropped from the host caches to make room."""
    resident: int = 0
    """Adapters in the host caches now."""
    cached_blocks: int = 0
    """Prefix-cache blocks computed through an adapter ..."""
    cached_blocks_not_resident: int = 0
    """... of which the adapter is not in the host caches (reusable only after a reload)."""
    adapters: tuple[AdapterCounters, ...] = ()
    parked_blocks: int = 0
    """KV blocks holding adapters' weights (the unified pool)."""

    @property
    def not_resident_share(self) -> float:
        return self.cached_blocks_not_resident / self.cached_blocks if self.cached_blocks else 0.0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    trace: TraceUpdate | None = None
    """The steps recorded since the previous outputs (and a block map, a few times a second),
    for the live dashboard: memwall/core/live_trace.py."""


@dataclass(frozen=True)
class EngineCoreInfo:
    """Facts about the loaded engine the API side needs (sent once, when the core is ready)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    description: str
    """The start-up line: KV cache size, context window, device."""
    structured_outputs_backend: str = "llguidance"
    """The grammar backend the core compiles with (the API side checks constraints with it)."""
    arch: ModelArchConfig | None = None
    """The model's shapes (the API side checks a LoRA adapter against them before loading)."""
    max_lora_rank: int | None = None
    """None: LoRA is off; else the largest adapter rank the workers' slots take."""
