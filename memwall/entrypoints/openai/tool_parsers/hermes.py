"""Hermes / Qwen2.5 tool calls: JSON objects wrapped in <tool_call> tags, after any content.

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several blocks may follow one another. Text outside them is content. A block whose JSON does not
parse, or has no string "name", stays content, tags included, so nothing the model wrote is lost.
A block ends at the first </tool_call> after its JSON (a tag inside a JSON string does not end
it); a last block with no closing tag (the stop string ate it) runs to the end of the text.

Streaming moves through modes, ``self._buffer`` holding what the current mode has not resolved:

    content     text is content, except an end that may be the start of "<tool_call>"
    block       after the tag: a CallStreamer reads the call object
    skip        after a call's object: drop text up to "</tool_call>"
    malformed   the block is not a call: collect it up to "</tool_call>", then send it as content
"""

from __future__ import annotations

from memwall.entrypoints.openai.tool_parsers.base import (
    CallStreamer,
    DeltaBuilder,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_object,
    decode_json_at,
    partial_tag_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(ToolParser):
    """Parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "content"
        self._call: CallStreamer | None = None
        self._search_from = 0  # malformed mode: where "</tool_call>" may start in the buffer

    def extract(self, text: str) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(OPEN_TAG, pos)) >= 0:
            content.append(text[pos:start])
            body = start + len(OPEN_TAG)
            decoded = decode_json_at(text, body)
            call = call_from_object(decoded[0], self.args_keys) if decoded else None
            # The closing tag is looked for after an object's JSON (the stream reads the object
            # first too); if the text is no object, from the start of the block.
            json_end = decoded[1] if decoded and isinstance(decoded[0], dict) else body
            close = text.find(CLOSE_TAG, json_end)
            pos = len(text) if close < 0 else close + len(CLOSE_TAG)
            if call is None:
                content.append(text[start:pos])
            else:
                calls.append(call)
        content.append(text[pos:])
        return ExtractedToolCalls(content="".join(content).strip() or None, tool_calls=calls)

    # ---- streaming ----

    def _advance(self, out: DeltaBuilder) -> bool:
        if self._mode == "content":
            return self._in_content(out)
        if self._mode == "block":
            return self._in_block(out)
        if self._mode == "skip":
            return self._in_skip()
        return self._in_malformed(out)

    def _flush(self, out: DeltaBuilder) -> None:
        if self._mode == "content":
            out.add_content(self._buffer)  # a partial "<tool_c" that never became a tag
        elif self._mode == "block" and self._call.committed:
            self._call.close(out)  # arguments cut off mid-way stay as sent: nothing to add
        elif self._mode == "block":  # no name yet, so no call: the block was content
            out.add_content(OPEN_TAG + self._call.read_text + self._buffer)
        elif self._mode == "malformed":
            out.add_content(OPEN_TAG + self._buffer)

    def _in_content(self, out: DeltaBuilder) -> bool:
        start = self._buffer.find(OPEN_TAG)
        if start < 0:
            keep = len(self._buffer) - partial_tag_len(self._buffer, OPEN_TAG)
            out.add_content(self._buffer[:keep])
            self._buffer = self._buffer[keep:]
            return False
        out.add_content(self._buffer[:start])
        self._buffer = self._buffer[start + len(OPEN_TAG):]
        self._call, self._mode = self._new_call(), "block"
        return True

    def _in_block(self, out: DeltaBuilder) -> bool:
        call = self._call
        end = self._feed_call(call, out)
        if end is None:
            return False
        if call.committed:
            call.close(out)
            self._buffer, self._mode = self._buffer[end:], "skip"
        else:
            # Not a call. As in extract(), its closing tag is looked for after the object when
            # the object closed, else anywhere after the opening tag.
            self._search_from = len(call.read_text) if call.reader.done else 0
            self._buffer, self._mode = call.read_text + self._buffer[end:], "malformed"
        return True

    def _in_skip(self) -> bool:
        close = self._buffer.find(CLOSE_TAG)
        if close < 0:
            self._buffer = self._buffer[len(self._buffer) - partial_tag_len(self._buffer,
                                                                           CLOSE_TAG):]
            return False
        self._buffer, self._mode = self._buffer[close + len(CLOSE_TAG):], "content"
        return True

    def _in_malformed(self, out: DeltaBuilder) -> bool:
        close = self._buffer.find(CLOSE_TAG, self._search_from)
        if close < 0:  # next time, look only where a tag could still start
            self._search_from = max(self._search_from, len(self._buffer) - len(CLOSE_TAG) + 1)
            return False
        end = close + len(CLOSE_TAG)
        out.add_content(OPEN_TAG + self._buffer[:end])
        self._buffer, self._mode = self._buffer[end:], "content"
        return True
