"""What /v1/completions and /v1/chat/completions share: admission checks, starting engine
requests, reading their outputs (with metrics), SSE framing, and client-disconnect handling.

The life of one HTTP request here:

    resolve_model -> check_capacity -> start() (one engine request per prompt; all or none)
      -> respond()   stream:     outputs() -> SSE chunks, flushed one by one -> "data: [DONE]"
                     non-stream: until_disconnect(final_outputs()) -> one JSON body

Leaving ``outputs()`` early for any reason (a disconnect cancels the task that reads it) aborts
every engine request it covers, so their KV blocks are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from memwall.engine.async_engine import AsyncLLMEngine, RequestStream
from memwall.entrypoints.openai.errors import APIError, api_error_from, bad_request
from memwall.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from memwall.entrypoints.openai.protocol import (
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    SamplingRequest,
    StructuredRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from memwall.entrypoints.openai.serving_lora import OpenAIServingModels
from memwall.lora.request import LoRARequest
from memwall.outputs import RequestOutput
from memwall.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
# Most choices (prompts x n) one request may ask for: beyond it one client can fill the engine.
MAX_CHOICES = 256
# JSON has no -inf; OpenAI clients expect a number, so impossible tokens get this instead.
MIN_LOGPROB = -9999.0


class ClientDisconnected(Exception):
    """The client went away before the response was ready; there is nobody to answer."""


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, models: OpenAIServingModels,
                 max_queue: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.models = models
        self.max_queue = max_queue

    @property
    def model_names(self) -> list[str]:
        """The base model's served names."""
        return self.models.base_names

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- admission -------------------------------------------------------------------------
    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to echo back, the LoRA adapter it names or None for the base model);
        404 for a model this server does not have."""
        return self.models.resolve(name)

    def check_model(self, name: str | None) -> str:
        """The served name to echo back; 404 for a model this server does not have."""
        return self.resolve_model(name)[0]

    def check_capacity(self) -> None:
        """429 with Retry-After once --max-queue requests are already waiting."""
        if self.max_queue is None:
            return
        waiting = self.engine.num_waiting
        if waiting >= self.max_queue:
            raise APIError(429, f"the server is busy: {waiting} requests are waiting (limit "
                                f"{self.max_queue}); retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})

    def check_common(self, request: SamplingRequest, num_prompts: int) -> None:
        if num_prompts * request.n > MAX_CHOICES:
            raise bad_request(f"{num_prompts} prompts x n={request.n} = {num_prompts * request.n} "
                              f"choices; at most {MAX_CHOICES} per request", "n")
        self.check_token_ids(request.stop_token_ids or [], "stop_token_ids")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in {param} is outside the vocabulary (0..{vocab - 1})",
                              param)

    def constrain(self, params: SamplingParams, request: StructuredRequest,
                  tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """Sets the request's output constraint (response_format, structured_outputs, or a
        tool-call grammar) on ``params`` and checks that it compiles: a 400 naming the param."""
        constraint, param = structured_constraint(request)
        if tool_constraint is not None:
            if constraint is not None:
                raise bad_request(f"{param} cannot be combined with a required or named "
                                  "tool_choice: the output is the tool call", param)
            constraint, param = tool_constraint, "tools"
        if constraint is not None:
            params.structured_outputs = constraint
            self.engine.processor.check_structured_outputs(params, param)
        return params

    def clamp(self, params: SamplingParams) -> SamplingParams:
        # top_k above the vocabulary means "no top-k"; the sampler must never see k > vocab.
        if params.top_k > self.engine.vocab_size:
            params.top_k = 0
        return params

    # ---- prompts ---------------------------------------------------------------------------
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation, as offline ``LLM.chat`` makes them (``Processor.render_chat``:
        the template places the special tokens). TokenizerError (400) for refused content."""
        return self.engine.processor.render_chat([template_message(m) for m in messages],
                                                 add_generation_prompt)

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt (text) or messages (a conversation)")
        if body.messages is not None:
            ids = self.render(body.messages, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = self._with_bos(ids)
        else:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        """BOS first, as ``encode(add_special_tokens=True)`` adds it: when the tokenizer wants
        one, and never a second."""
        tok = self.tokenizer
        if tok.add_bos_token and not (ids and ids[0] == tok.bos_token_id):
            return [tok.bos_token_id, *ids]
        return ids

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    # ---- running ---------------------------------------------------------------------------
    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def start(self, request_id: str, prompts: list, params: SamplingParams,
                    lora_request: LoRARequest | None = None
                    ) -> tuple[list[RequestStream], list[RequestTracker]]:
        """Adds one engine request per prompt (each through ``lora_request``'s adapter, if
        given); if one is refused, the others are aborted."""
        trackers = [self.metrics.tracker() for _ in prompts]
        streams: list[RequestStream] = []
        try:
            for index, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(await self.engine.add_request(rid, prompt, params, lora_request))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams, trackers

    async def outputs(self, streams: list[RequestStream], trackers: list[RequestTracker]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they arrive; leaving early aborts them."""
        try:
            if len(streams) == 1:
                async for output in self.engine.iterate(streams[0]):
                    trackers[0].observe(output)
                    yield 0, output
                return
            async for index, output in _merge([self.engine.iterate(s) for s in streams]):
                trackers[index].observe(output)
                yield index, output
        finally:
            for stream in streams:
                if not stream.finished:
                    self.engine.abort(stream.request_id)
            for tracker in trackers:
                tracker.close()

    async def final_outputs(self, streams: list[RequestStream], trackers: list[RequestTracker]
                            ) -> list[RequestOutput]:
        """The finished output of each stream, its texts rebuilt from the streamed deltas.

        Why rebuild: the engine's final ``text`` is read before the detokenizer's last flush
        (a trailing incomplete character), so it can lack what the deltas carried. Joining the
        deltas makes a non-streamed response equal to the streamed one, always.
        """
        last: dict[int, RequestOutput] = {}
        texts: dict[tuple[int, int], list[str]] = {}
        async for index, output in self.outputs(streams, trackers):
            last[index] = output
            for sample in output.outputs:
                texts.setdefault((index, sample.index), []).append(sample.delta_text)
        for index, output in last.items():
            for sample in output.outputs:
                sample.text = "".join(texts[(index, sample.index)])
        return [last[i] for i in range(len(streams))]

    # ---- responses -------------------------------------------------------------------------
    @staticmethod
    def usage(outputs: list[RequestOutput]) -> UsageInfo:
        """Prompt tokens count once per prompt (not per choice), as OpenAI bills them."""
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    async def respond(self, raw: Request, stream: bool, streams: list[RequestStream],
                      trackers: list[RequestTracker], make_chunks: Callable[[], AsyncIterator[BaseModel]],
                      make_body: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """The SSE stream, or the JSON body once all is done; a client gone at any point aborts."""
        if stream:
            return SSEResponse(self.sse_events(make_chunks()),
                               on_close=lambda: self.abort_unfinished(streams, trackers))
        try:
            outputs = await until_disconnect(raw, self.final_outputs(streams, trackers))
        except ClientDisconnected:
            self.abort_unfinished(streams, trackers)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return JSONResponse(make_body(outputs).model_dump())

    def abort_unfinished(self, streams: list[RequestStream], trackers: list[RequestTracker]) -> None:
        """Covers a response that ended before reading its streams (then outputs() never ran)."""
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)
        for tracker in trackers:
            tracker.close()

    @staticmethod
    async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        """SSE-frames chunks; an error after the headers went out becomes an error event."""
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as exc:  # noqa: BLE001 - the status line is gone; tell the client in-band
            yield sse(api_error_from(exc).body)
        yield SSE_DONE


class SSEResponse(StreamingResponse):
    """Server-sent events, each sent (and flushed) as soon as it is yielded; ``on_close`` runs
    however the response ends (finished, client gone, or cancelled before the first event)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work`` unless the client disconnects first; then cancels it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read by now, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items from several async iterators as they come, tagged with the iterator's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((index, exc))
        queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


# The body's keys: StructuredOutputsParams' fields, less the backend (memwall's own choice)
STRUCTURED_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.name != "backend")


def structured_constraint(request: StructuredRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request asks for, and the param that asked: OpenAI's response_format
    ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}), or vLLM's structured_outputs object."""
    fmt, body = request.response_format, request.structured_outputs
    if body is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_request("give either response_format or structured_outputs, not both",
                              "structured_outputs")
        unknown = sorted(set(body) - set(STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported; use "
                              f"{', '.join(STRUCTURED_KEYS)}", "structured_outputs")
        try:
            return StructuredOutputsParams(**body), "structured_outputs"
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request('response_format of type "json_schema" needs json_schema.schema',
                          "response_format")
    try:
        return StructuredOutputsParams(json=fmt.json_schema.json_schema), "response_format"
    except ValueError as e:
        raise bad_request(str(e), "response_format") from None


def template_message(message: ChatMessage) -> dict:
    """A message as chat templates expect it: role and plain-string content."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"content parts of type {part.type!r} are not supported: this "
                                  "server takes text only ({\"type\": \"text\", \"text\": ...})",
                                  "messages")
            texts.append(part.text)
        content = "\n".join(texts)
    # Templates written for "system" often reject OpenAI's newer "developer" role.
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": content or ""}
    if message.name:
        out["name"] = message.name
    return out
