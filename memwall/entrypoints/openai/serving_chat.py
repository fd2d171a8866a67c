"""POST /v1/chat/completions: messages -> chat template -> token ids -> chat.completion(.chunk).

The prompt is rendered exactly as the offline ``LLM.chat`` renders it (template, then encode
without adding special tokens: the template places them), so greedy outputs match offline ones.
A stream sends, per choice, a first chunk with the role, then content deltas, then a chunk with
the finish reason; with stream_options.include_usage one more chunk with the usage only.

With tools (entrypoints/openai/tool_calling.py) each choice's text goes through a tool parser:
a response carries ``message.tool_calls``, a stream ``delta.tool_calls`` pieces (index, id and
name once, arguments in pieces), and the finish reason is "tool_calls" when the model called one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from memwall.entrypoints.openai.errors import bad_request
from memwall.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from memwall.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    OpenAIServing,
    safe_logprob,
)
from memwall.entrypoints.openai.tool_calling import (ToolSetup, resolve_tools,
                                                     template_messages)
from memwall.entrypoints.openai.tool_parsers import StreamDelta, ToolParser
from memwall.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass(frozen=True)
class ToolSettings:
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" is allowed (vLLM's --enable-auto-tool-choice)."""
    tool_call_parser: str | None = None
    """hermes or llama3_json; None: chosen from the chat template."""


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tools: ToolSettings | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_settings = tools or ToolSettings()

    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        model, lora = self.resolve_model(request.model)
        self.check_common(request, 1)
        top_logprobs = self._top_logprobs(request)
        settings = self.tool_settings
        setup = resolve_tools(request, self.tokenizer.chat_template,
                              settings.enable_auto_tool_choice, settings.tool_call_parser)
        messages = template_messages(request.messages, setup)
        prompt_ids = self.engine.processor.render_chat(
            messages, request.add_generation_prompt, tools=setup.template_tools() if setup else None)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.clamp(request.sampling_params(max_tokens, top_logprobs))
        self.constrain(params, request, setup.constraint() if setup else None)
        self.check_capacity()
        request_id = self.new_id("chatcmpl")
        streams, trackers = await self.start(request_id, [prompt_ids], params, lora)
        return await self.respond(
            raw, bool(request.stream), streams, trackers,
            lambda: self._stream(request, request_id, model, streams, trackers, setup),
            lambda outputs: self._response(request, request_id, model, outputs[0], setup))

    @staticmethod
    def _top_logprobs(request: ChatCompletionRequest) -> int | None:
        """The engine's logprobs count: None (off), or how many alternatives per position."""
        if not request.logprobs:
            if request.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return request.top_logprobs or 0

    # ---- non-streaming ---------------------------------------------------------------------
    def _response(self, request: ChatCompletionRequest, request_id: str, model: str,
                  output: RequestOutput, setup: ToolSetup | None) -> ChatCompletionResponse:
        choices = []
        for sample in output.outputs:
            message, finish = ChatResponseMessage(content=sample.text), sample.finish_reason
            if setup is not None and setup.parses:
                message, finish = self._tool_message(sample, setup)
            choices.append(ChatChoice(index=sample.index, message=message,
                                      logprobs=self._logprobs(request, sample.token_ids, sample.logprobs),
                                      finish_reason=finish, stop_reason=sample.stop_reason))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage([output]))

    @staticmethod
    def _tool_message(sample: CompletionOutput, setup: ToolSetup) -> tuple[ChatResponseMessage, str]:
        extracted = setup.parser().extract(sample.text)
        calls = extracted.tool_calls if setup.parallel else extracted.tool_calls[:1]
        message = ChatResponseMessage(
            content=extracted.content,
            tool_calls=[ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                        for c in calls] or None)
        finish = sample.finish_reason
        return message, ("tool_calls" if calls and finish == "stop" else finish)

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  entries: list[PositionLogprobs] | None) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        top_n = request.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries or []):
            chosen = entry.get(token_id) if entry else None
            token = self._token_text(token_id, chosen)
            ranked = sorted((lp for lp in (entry or {}).values() if lp.rank is not None and lp.rank <= top_n),
                            key=lambda lp: lp.rank)
            content.append(ChatLogprobToken(
                token=token, logprob=safe_logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=safe_logprob(lp.logprob),
                                         bytes=list((lp.decoded_token or "").encode("utf-8")))
                              for lp in ranked]))
        return ChatLogprobs(content=content)

    def _token_text(self, token_id: int, chosen) -> str:
        if chosen is not None and chosen.decoded_token is not None:
            return chosen.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str, streams,
                      trackers, setup: ToolSetup | None = None) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage)

        # The role comes first, before any token: clients render the bubble at once.
        for index in range(request.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        finished: set[int] = set()
        parsers: dict[int, ToolParser] = {}
        last: RequestOutput | None = None
        async for _, output in self.outputs(streams, trackers):
            last = output
            usage = self.usage([output]) if request.continuous_usage else None
            for sample in output.outputs:
                if setup is not None and setup.parses:
                    parser = parsers.setdefault(sample.index, setup.parser())
                    choice = self._tool_delta_choice(request, sample, finished, parser, setup)
                else:
                    choice = self._delta_choice(request, sample, finished)
                if choice is not None:
                    yield chunk([choice], usage)
        if request.include_usage and last is not None:
            yield chunk([], self.usage([last]))

    def _delta_choice(self, request: ChatCompletionRequest, sample: CompletionOutput,
                      finished: set[int]) -> ChatStreamChoice | None:
        if sample.index in finished:
            return None  # with n > 1 a finished sample keeps appearing in later outputs
        if not sample.delta_text and not sample.delta_token_ids and not sample.finished:
            return None
        if sample.finished:
            finished.add(sample.index)
        content = sample.delta_text if sample.delta_text or not sample.finished else None
        return ChatStreamChoice(
            index=sample.index, delta=DeltaMessage(content=content),
            logprobs=self._logprobs(request, sample.delta_token_ids, sample.delta_logprobs),
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)


    def _tool_delta_choice(self, request: ChatCompletionRequest, sample: CompletionOutput,
                           finished: set[int], parser: ToolParser,
                           setup: ToolSetup) -> ChatStreamChoice | None:
        """A choice's new text through its tool parser: content and call pieces."""
        if sample.index in finished:
            return None
        delta = parser.feed(sample.delta_text) if sample.delta_text else StreamDelta()
        if sample.finished:
            finished.add(sample.index)
            tail = parser.finish()
            delta = StreamDelta((delta.content or "") + (tail.content or "") or None,
                                delta.tool_calls + tail.tool_calls)
        calls = [c for c in delta.tool_calls if setup.parallel or c.index == 0]
        if delta.content is None and not calls and not sample.finished and not sample.delta_token_ids:
            return None
        finish = sample.finish_reason
        if finish == "stop" and parser.num_calls:
            finish = "tool_calls"
        pieces = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for c in calls]
        return ChatStreamChoice(
            index=sample.index, delta=DeltaMessage(content=delta.content, tool_calls=pieces or None),
            logprobs=self._logprobs(request, sample.delta_token_ids, sample.delta_logprobs),
            finish_reason=finish, stop_reason=sample.stop_reason)
