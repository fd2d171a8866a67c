"""The wire format: pydantic models for OpenAI-compatible requests and responses.

Field names, types and defaults follow the OpenAI API reference; memwall extensions (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, ...) follow vLLM's names. Bounds live here so
that a bad value is a 400 with the field's name before anything reaches the engine; the rest of
the validation is ``SamplingParams``' own (one source of truth for the messages).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memwall.sampling_params import SamplingParams

# Upper bounds that keep one request from monopolising the server (or the sampler's tensors).
MAX_N = 128
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

NonEmptyTokens = Annotated[list[int], Field(min_length=1)]


def _omitted_if_none(default: Any = None) -> Any:
    """A response field left out of the JSON when None: OpenAI's spec makes it optional but
    not nullable (e.g. a stream delta's role after the first chunk)."""
    return Field(default, exclude_if=lambda value: value is None)


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); NaN and Infinity are refused, since
    # Python's JSON parser accepts them and they would poison a whole batch's logits.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    """Send one last chunk with the request's usage (and no choices) before [DONE]."""
    continuous_usage_stats: bool | None = False
    """Attach the usage so far to every chunk (vLLM extension)."""


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    """Served model name; None means the one model this server has."""
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # memwall / vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # Far below 1 a penalty divides logits by ~0 and overflows them; far above it is just noise.
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    """Lower runs first when the server runs with --scheduling-policy priority."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError (-> 400) with SamplingParams' message for values it refuses."""
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                        presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty)
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, priority=self.priority,
            **{k: v for k, v in optional.items() if v is not None})


# ---- structured outputs and tools (requests) ---------------------------------------------------
class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredRequest(OpenAIModel):
    """Fields for constrained output, on both endpoints: OpenAI's ``response_format`` and vLLM's
    ``structured_outputs`` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...})."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIModel):
    name: str
    arguments: str
    """The arguments object as JSON text (as OpenAI sends it)."""


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ---- /v1/completions ---------------------------------------------------------------------------
class CompletionRequest(SamplingRequest, StructuredRequest):
    prompt: str | NonEmptyTokens | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[NonEmptyTokens], Field(min_length=1)]
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _omitted_if_none()


# ---- /v1/chat/completions ----------------------------------------------------------------------
class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls (the conversation so far)."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""


class ChatCompletionRequest(SamplingRequest, StructuredRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of max_completion_tokens; still honoured."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" when tools are given, else "none"."""
    parallel_tool_calls: bool = True


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None
    refusal: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    refusal: str | None = None
    """Always null: memwall never refuses (the field is required by OpenAI's schema)."""
    tool_calls: list[ToolCall] | None = _omitted_if_none()


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIModel):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class DeltaToolCall(OpenAIModel):
    """A piece of a streamed call: id, type and name come once (its first delta), the
    arguments' JSON text in pieces after."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: DeltaFunctionCall | None = _omitted_if_none()


class DeltaMessage(OpenAIModel):
    role: str | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_if_none()


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, errors -----------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "memwall"
    max_model_len: int | None = None
    root: str | None = None
    """vLLM's: the model, or a LoRA adapter's path."""
    parent: str | None = None
    """vLLM's: a LoRA adapter's base model (None for the base model itself)."""


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    """A PEFT directory or a GGUF LoRA file, as the server's machine sees it."""


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (vLLM's body; its lora_int_id is accepted and ignored)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None


class TokenizeRequest(OpenAIModel):
    """Either a prompt (text) or messages (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    """Default: True for a prompt (BOS, as for completions), False for messages (the template has it)."""


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
