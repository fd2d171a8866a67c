"""POST /v1/chat/completions: messages -> chat template -> token ids -> chat.completion(.chunk).

The prompt is rendered exactly as the offline ``LLM.chat`` renders it (template, then encode
without adding special tokens: the template places them), so greedy outputs match offline ones.
A stream sends, per choice, a first chunk with the role, then content deltas, then a chunk with
the finish reason; with stream_options.include_usage one more chunk with the usage only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

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
    DeltaMessage,
    TopLogprob,
)
from memwall.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    OpenAIServing,
    safe_logprob,
)
from memwall.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(request.model)
        self.check_common(request, 1)
        top_logprobs = self._top_logprobs(request)
        prompt_ids = self.render(request.messages, request.add_generation_prompt)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.clamp(request.sampling_params(max_tokens, top_logprobs))
        self.check_capacity()
        request_id = self.new_id("chatcmpl")
        streams, trackers = await self.start(request_id, [prompt_ids], params)
        return await self.respond(
            raw, bool(request.stream), streams, trackers,
            lambda: self._stream(request, request_id, model, streams, trackers),
            lambda outputs: self._response(request, request_id, model, outputs[0]))

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
                  output: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=sample.index, message=ChatResponseMessage(content=sample.text),
                       logprobs=self._logprobs(request, sample.token_ids, sample.logprobs),
                       finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)
            for sample in output.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage([output]))

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
                      trackers) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage)

        # The role comes first, before any token: clients render the bubble at once.
        for index in range(request.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        finished: set[int] = set()
        last: RequestOutput | None = None
        async for _, output in self.outputs(streams, trackers):
            last = output
            usage = self.usage([output]) if request.continuous_usage else None
            for sample in output.outputs:
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

