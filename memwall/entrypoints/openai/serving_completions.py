"""POST /v1/completions: prompt(s) -> engine requests -> text_completion (JSON or SSE chunks).

Choice indexes follow OpenAI: prompt i, sample j -> index i * n + j. With ``echo`` the prompt
text leads each choice (and, with ``logprobs``, the prompt tokens' logprobs lead the logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from memwall.entrypoints.openai.errors import bad_request
from memwall.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from memwall.entrypoints.openai.serving_engine import OpenAIServing, safe_logprob
from memwall.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class _Choice:
    """Streaming state of one choice: where its text (and text_offset) has got to."""

    echoed: bool = False
    offset: int = 0
    finished: bool = False
    """Its finish chunk was sent: with n > 1 a finished sample keeps appearing in later outputs."""


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        model, lora = self.resolve_model(request.model)
        prompts = self._prompts(request)
        self.check_common(request, len(prompts))
        if request.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if request.stream and request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs is only supported without streaming", "echo")
        params = self.clamp(request.sampling_params(
            request.max_tokens, request.logprobs,
            prompt_logprobs=request.logprobs if request.echo else None))
        self.constrain(params, request)
        self.check_capacity()
        request_id = self.new_id("cmpl")
        streams, trackers = await self.start(request_id, prompts, params, lora)
        return await self.respond(
            raw, bool(request.stream), streams, trackers,
            lambda: self._stream(request, request_id, model, prompts, streams, trackers),
            lambda outputs: self._response(request, request_id, model, prompts, outputs))

    def _prompts(self, request: CompletionRequest) -> list:
        """The prompt field as a list of prompts (strings or token-id lists)."""
        prompt = request.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        for p in prompts:
            if isinstance(p, list):
                self.check_token_ids(p, "prompt")
        return prompts

    def _prompt_text(self, prompt, output: RequestOutput) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(output.prompt_token_ids)

    # ---- non-streaming ---------------------------------------------------------------------
    def _response(self, request: CompletionRequest, request_id: str, model: str, prompts: list,
                  outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(outputs):
            for sample in output.outputs:
                choices.append(self._choice(request, i * request.n + sample.index,
                                            prompts[i], output, sample))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(outputs))

    def _choice(self, request: CompletionRequest, index: int, prompt, output: RequestOutput,
                sample: CompletionOutput) -> CompletionChoice:
        text, logprobs = sample.text, None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if request.echo:
                self._add_logprobs(logprobs, output.prompt_token_ids, output.prompt_logprobs or [],
                                   request.logprobs)
            self._add_logprobs(logprobs, sample.token_ids, sample.logprobs or [], request.logprobs)
        if request.echo:
            text = self._prompt_text(prompt, output) + text
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)

    def _add_logprobs(self, into: CompletionLogprobs, token_ids: list[int],
                      entries: list[PositionLogprobs | None], top_n: int) -> None:
        """Appends OpenAI's legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""
        offset = into.text_offset[-1] + len(into.tokens[-1]) if into.tokens else 0
        for position, token_id in enumerate(token_ids):
            entry = entries[position] if position < len(entries) else None
            chosen = entry.get(token_id) if entry else None
            token = chosen.decoded_token if chosen and chosen.decoded_token is not None \
                else self.tokenizer.decode([token_id], skip_special_tokens=False)
            into.tokens.append(token)
            into.text_offset.append(offset)
            offset += len(token)
            into.token_logprobs.append(safe_logprob(chosen.logprob) if chosen else None)
            into.top_logprobs.append(_top_dict(entry, top_n) if entry else None)

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, request: CompletionRequest, request_id: str, model: str, prompts: list,
                      streams, trackers) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())
        states: dict[int, _Choice] = {}
        latest: dict[int, RequestOutput] = {}
        async for i, output in self.outputs(streams, trackers):
            latest[i] = output
            usage = self.usage(list(latest.values())) if request.continuous_usage else None
            for sample in output.outputs:
                index = i * request.n + sample.index
                state = states.setdefault(index, _Choice())
                choice = self._delta_choice(request, index, prompts[i], output, sample, state)
                if choice is not None:
                    yield CompletionResponse(id=request_id, created=created, model=model,
                                             choices=[choice], usage=usage)
        if request.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=self.usage(list(latest.values())))

    def _delta_choice(self, request: CompletionRequest, index: int, prompt, output: RequestOutput,
                      sample: CompletionOutput, state: _Choice) -> CompletionChoice | None:
        if state.finished:
            return None
        state.finished = sample.finished
        text = sample.delta_text
        if request.echo and not state.echoed:
            text = self._prompt_text(prompt, output) + text
            state.echoed = True
        if not text and not sample.delta_token_ids and not sample.finished:
            return None  # nothing new for this choice in this step
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            self._add_logprobs(logprobs, sample.delta_token_ids, sample.delta_logprobs or [],
                               request.logprobs)
            base = state.offset + len(text) - len(sample.delta_text)  # after any echoed prompt
            logprobs.text_offset = [base + o for o in logprobs.text_offset]
        state.offset += len(text)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason)


def _top_dict(entry: PositionLogprobs, top_n: int) -> dict[str, float]:
    """The top_n most likely tokens at a position, as OpenAI's {token text: logprob}."""
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n),
                    key=lambda lp: lp.rank)
    top: dict[str, float] = {}
    for lp in ranked:  # two ids can decode alike (e.g. partial UTF-8 -> U+FFFD): keep the likelier
        top.setdefault(lp.decoded_token or "", safe_logprob(lp.logprob))
    return top

