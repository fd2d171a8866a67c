"""Llama 3.x JSON tool calls: the whole output is the calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The "<|python_tag|>" is optional (Llama 3.1 writes it before tool calls; without
``skip_special_tokens`` it reaches the text). Several objects may follow one another, separated
by ";" or whitespace; "arguments" is accepted in place of "parameters". An output that does not
start with "{" (after the tag) is plain content with no calls. Calls end at the first text that
is not another call object; that text and everything after it is content (the tag never is).

Streaming modes, ``self._buffer`` holding what the current mode has not resolved:

    start     before the first non-whitespace text; holds an end that may start the tag
    calls     between call objects: skip ";" and whitespace, then "{" starts the next object
    object    a CallStreamer reads the call object
    content   everything from here on is content
"""

from __future__ import annotations

from memwall.entrypoints.openai.tool_parsers.base import (
    JSON_WS,
    CallStreamer,
    DeltaBuilder,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_object,
    decode_json_at,
    skip_chars,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = JSON_WS + ";"


class Llama3JsonToolParser(ToolParser):
    """Parses ``{"name": ..., "parameters": {...}}`` objects that make up the whole output."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._call: CallStreamer | None = None

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        elif not body.startswith("{"):
            return ExtractedToolCalls(content=body.rstrip() or None, tool_calls=[])
        calls: list[ToolCall] = []
        pos = 0
        while body.startswith("{", pos := skip_chars(body, pos, SEPARATORS)):
            decoded = decode_json_at(body, pos)
            call = call_from_object(decoded[0], self.args_keys) if decoded else None
            if call is None:
                break
            calls.append(call)
            pos = decoded[1]
        return ExtractedToolCalls(content=body[pos:].strip() or None, tool_calls=calls)

    # ---- streaming ----

    def _advance(self, out: DeltaBuilder) -> bool:
        if self._mode == "start":
            return self._at_start()
        if self._mode == "calls":
            return self._between_calls()
        if self._mode == "object":
            return self._in_object(out)
        out.add_content(self._buffer)
        self._buffer = ""
        return False

    def _flush(self, out: DeltaBuilder) -> None:
        if self._mode == "object" and self._call.committed:
            self._call.close(out)  # arguments cut off mid-way stay as sent: nothing to add
        elif self._mode == "object":  # no name yet, so no call: the object was content
            out.add_content(self._call.read_text + self._buffer)
        else:
            out.add_content(self._buffer)  # e.g. "<|python" that never became the tag

    def _at_start(self) -> bool:
        text = self._buffer.lstrip()
        if text.startswith(PYTHON_TAG):
            self._buffer, self._mode = text[len(PYTHON_TAG):], "calls"
        elif text.startswith("{"):
            self._buffer, self._mode = text, "calls"
        elif not text or PYTHON_TAG.startswith(text):
            return False  # may still become the tag: wait for more
        else:
            self._buffer, self._mode = text, "content"
        return True

    def _between_calls(self) -> bool:
        self._buffer = self._buffer[skip_chars(self._buffer, 0, SEPARATORS):]
        if not self._buffer:
            return False
        if self._buffer.startswith("{"):
            self._call, self._mode = self._new_call(), "object"
        else:
            self._mode = "content"
        return True

    def _in_object(self, out: DeltaBuilder) -> bool:
        call = self._call
        end = self._feed_call(call, out)
        if end is None:
            return False
        if call.committed:
            call.close(out)
            # A call broken after its name was sent stays a call; the rest is content.
            self._buffer = self._buffer[end:]
            self._mode = "calls" if call.reader.done else "content"
        else:
            self._buffer, self._mode = call.read_text + self._buffer[end:], "content"
        return True
