"""Tool-call parsing: the shapes parsers return, and the streaming machinery they share.

A model asks for tools by writing text in the format its chat template taught it (Hermes tags,
Llama 3 JSON, ...). A parser turns that text into OpenAI tool calls, either from the complete
output (``extract``) or piece by piece as it is generated (``feed``, then ``finish``).

Streaming follows OpenAI's delta rules: a call's id and name are sent once, in its first delta,
and its arguments follow as JSON text in pieces that concatenate to the arguments object. Three
pieces make that possible without re-parsing the whole text on every token:

    JsonValueScanner   follows one JSON value and says where it ends (strings, escapes, depth),
                       so arguments are forwarded raw as they arrive and stop at their last brace
    CallObjectReader   walks the top level of one call object {"name": ..., "arguments": ...},
                       a scanner per key and value; reports the name once it is complete and the
                       arguments text as it comes; checks every value with json.loads as it ends
    CallStreamer       turns a reader's progress into ToolCallDeltas (id and name first)

A stream cannot take back what it sent, so a call is committed once its name is complete. If
the object breaks after that (or the stream stops inside it), the stream keeps the call with
the arguments that arrived, where ``extract`` would leave the text as content. Everything that
is decided before the name, and every well-formed output, comes out the same both ways.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

JSON_WS = " \t\r\n"  # the only whitespace JSON allows between tokens
ARGUMENTS_KEYS = ("arguments", "parameters")  # Hermes/Qwen write "arguments", Llama 3 "parameters"
_SCALAR_ENDS = frozenset(",:]}" + JSON_WS)  # a number or literal ends before one of these
_VALUE_STARTS = frozenset('{["-0123456789tfnNI')  # NaN and Infinity: json.loads accepts them


def new_tool_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call the model asked for; ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A complete output, split: the text outside the calls (stripped; None when empty)."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, as in OpenAI's ``delta.tool_calls[i]``: ``id`` and ``name``
    come once, in a call's first delta; ``arguments`` pieces concatenate to the JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    """What one piece of model output adds to the response: content, call pieces, or neither."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---- complete texts ------------------------------------------------------------------------

def decode_json_at(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value starting at ``pos`` (after JSON whitespace) and the index just past it;
    None if no valid value starts there."""
    while pos < len(text) and text[pos] in JSON_WS:
        pos += 1
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        return None


def arguments_text(value: object) -> str:
    """The arguments JSON text for a parsed arguments value. A string is taken to be JSON text
    already (some models quote the object); an empty one means no arguments."""
    if isinstance(value, str):
        return value if value.strip() else "{}"
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: object, args_keys: tuple[str, ...] = ARGUMENTS_KEYS) -> ToolCall | None:
    """A ToolCall from a parsed call object, or None if it is not one (no non-empty string name).
    The first key of ``args_keys`` present holds the arguments; none present means "{}"."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in obj if k in args_keys), None)
    arguments = "{}" if key is None else arguments_text(obj[key])
    return ToolCall(id=new_tool_call_id(), name=obj["name"], arguments=arguments)


def skip_chars(text: str, pos: int, chars: str) -> int:
    """The first index at or after ``pos`` whose character is not in ``chars``."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``: text to hold back,
    since the next piece may complete the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---- streams: where a JSON value ends ------------------------------------------------------

class JsonValueScanner:
    """Follows one JSON value through text that arrives in pieces and finds where it ends.

    It tracks only what decides the end: inside a string or not, just after a backslash or not,
    and the depth of {} and [] together (mismatched brackets are json.loads's to reject). A scalar
    (number, true, false, null) has no closing character: it ends just before the first character
    that cannot continue it, and that character is left to the caller.
    """

    def __init__(self) -> None:
        self.done = False
        self._started = False
        self._scalar = False
        self._in_string = False
        self._escaped = False
        self._depth = 0

    def feed(self, text: str, start: int = 0) -> int:
        """Consume ``text[start:]`` up to the value's end; return the index just past the part
        that belongs to the value (``len(text)`` while it has not ended). The first character
        ever fed must start the value."""
        i = start
        while i < len(text) and not self.done and self._step(text[i]):
            i += 1
        return i

    def _step(self, ch: str) -> bool:
        """Take one character; False when it ends a scalar and so is not part of the value."""
        if not self._started:
            self._started = True
            self._scalar = ch not in '{["'
        elif self._scalar:
            self.done = ch in _SCALAR_ENDS
            return not self.done
        if self._scalar:
            return True
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                self.done = self._depth == 0
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            self.done = self._depth == 0
        return True


class CallObjectReader:
    """Reads one call object ``{"name": "f", "arguments": {...}}`` as its text streams in.

    After each ``feed``: ``name`` is set once the name string is complete (a non-empty string);
    ``take_arguments()`` returns the arguments text that arrived since it was last called;
    ``done`` says the object closed, ``invalid`` that its text broke JSON's grammar (the breaking
    character is not consumed). Keys may come in any order; the first key of ``args_keys`` holds
    the arguments. Arguments written as a JSON string are decoded (their content is the arguments
    text), so they come whole when the string ends; any other value is forwarded raw.
    """

    def __init__(self, args_keys: tuple[str, ...] = ARGUMENTS_KEYS) -> None:
        self.args_keys = args_keys
        self.name: str | None = None
        self.args_seen = False
        self._state = "open"
        self._role = ""  # the token being scanned: "key", "name", "args", "args-string", "other"
        self._key = ""
        self._scanner = JsonValueScanner()
        self._raw: list[str] = []  # the token's text, checked by json.loads when it ends
        self._args_out: list[str] = []

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def invalid(self) -> bool:
        return self._state == "invalid"

    def take_arguments(self) -> str:
        text = "".join(self._args_out)
        self._args_out.clear()
        return text

    def feed(self, text: str, start: int = 0) -> int:
        """Consume ``text[start:]`` up to the end of the object, or up to the character that
        breaks it; return the index just past what was consumed."""
        i = start
        while i < len(text) and self._state not in ("done", "invalid"):
            if self._state == "token":
                i = self._scan(text, i)
            elif text[i] in JSON_WS:
                i += 1
            else:
                i = self._punctuation(text, i)
        return i

    def _punctuation(self, text: str, i: int) -> int:
        """Act on the character between tokens at ``i``; return where to go on from."""
        ch, state = text[i], self._state
        if state == "open" and ch == "{":
            self._state = "key_or_close"
        elif state in ("key_or_close", "key") and ch == '"':
            self._begin("key")
            return i  # the scanner takes the opening quote
        elif state in ("key_or_close", "comma_or_close") and ch == "}":
            self._state = "done"
        elif state == "colon" and ch == ":":
            self._state = "value"
        elif state == "value" and ch in _VALUE_STARTS:
            self._begin(self._value_role(ch))
            return i
        elif state == "comma_or_close" and ch == ",":
            self._state = "key"
        else:
            self._state = "invalid"
            return i
        return i + 1

    def _value_role(self, first: str) -> str:
        if self._key == "name":
            return "name"
        if self._key in self.args_keys and not self.args_seen:
            self.args_seen = True
            return "args-string" if first == '"' else "args"
        return "other"

    def _begin(self, role: str) -> None:
        self._state, self._role = "token", role
        self._scanner = JsonValueScanner()
        self._raw = []

    def _scan(self, text: str, i: int) -> int:
        end = self._scanner.feed(text, i)
        self._raw.append(text[i:end])
        if self._role == "args":
            self._args_out.append(text[i:end])
        if self._scanner.done:
            self._end_token()
        return end

    def _end_token(self) -> None:
        try:
            value = json.loads("".join(self._raw))
        except ValueError:  # e.g. a bad escape, or `tru`: the scanner does not validate
            self._state = "invalid"
            return
        self._state = "comma_or_close"
        if self._role == "key":
            self._key, self._state = value, "colon"
        elif self._role == "name" and self.name is None and isinstance(value, str) and value:
            self.name = value
        elif self._role == "args-string":
            self._args_out.append(arguments_text(value))


class CallStreamer:
    """Streams one call object as OpenAI deltas: nothing until its name is complete, then one
    delta with id and name (and any arguments written before the name), then arguments pieces.

    Until it commits (takes an index) it keeps the text it read, which the parser turns back into
    content if no call comes of it.
    """

    def __init__(self, next_index: Callable[[], int],
                 args_keys: tuple[str, ...] = ARGUMENTS_KEYS) -> None:
        self.reader = CallObjectReader(args_keys)
        self.index: int | None = None
        self._next_index = next_index
        self._read: list[str] = []

    @property
    def committed(self) -> bool:
        return self.index is not None

    @property
    def read_text(self) -> str:
        """The text read before the call committed (all of it, if it never did)."""
        return "".join(self._read)

    def feed(self, text: str, out: DeltaBuilder) -> int:
        """Read ``text`` up to the object's end (or the character that breaks it); put the deltas
        it allows into ``out``; return the index just past what was read."""
        end = self.reader.feed(text)
        if not self.committed:
            self._read.append(text[:end])
            if self.reader.name is None:
                return end
            self.index = self._next_index()
            out.add_call(ToolCallDelta(self.index, new_tool_call_id(), self.reader.name))
        arguments = self.reader.take_arguments()
        if arguments:
            out.add_call(ToolCallDelta(self.index, arguments=arguments))
        return end

    def close(self, out: DeltaBuilder) -> None:
        """At the end of the object or stream: a committed call with no arguments key gets "{}",
        as extract() gives it."""
        if self.committed and not self.reader.args_seen:
            out.add_call(ToolCallDelta(self.index, arguments="{}"))


# ---- streams: assembling deltas ------------------------------------------------------------

class ContentTrimmer:
    """Streams content the way extract() reports it, stripped: leading whitespace is dropped
    until something else arrives; trailing whitespace is held until more content follows it
    (dropped if none does), so whitespace between calls never reaches the client on its own."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        """The part of ``text`` to send now."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body


class DeltaBuilder:
    """Collects what one ``feed``/``finish`` call produces into one StreamDelta, merging a call's
    consecutive pieces (so a call's first delta carries id, name and the arguments so far)."""

    def __init__(self, trimmer: ContentTrimmer) -> None:
        self._trimmer = trimmer
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []

    def add_content(self, text: str) -> None:
        piece = self._trimmer.push(text) if text else ""
        if piece:
            self._content.append(piece)

    def add_call(self, delta: ToolCallDelta) -> None:
        last = self._calls[-1] if self._calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments = (last.arguments or "") + (delta.arguments or "")
        else:
            self._calls.append(delta)

    def build(self) -> StreamDelta:
        return StreamDelta(content="".join(self._content) or None, tool_calls=self._calls)


# ---- the parser interface --------------------------------------------------------------------

class ToolParser(ABC):
    """Turns one model output into tool calls: ``extract`` reads a complete text; ``feed`` and
    ``finish`` read a stream. Streaming keeps state between pieces: one instance per stream.

    Subclasses stream by resolving ``self._buffer`` (text received, not yet resolved) in
    ``_advance`` and emptying it at the end in ``_flush``.
    """

    args_keys: tuple[str, ...] = ARGUMENTS_KEYS

    def __init__(self) -> None:
        self._buffer = ""
        self._num_calls = 0
        self._trimmer = ContentTrimmer()

    @property
    def num_calls(self) -> int:
        """Calls started in the stream so far (each has had its first delta)."""
        return self._num_calls

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a complete output, in order, and the content around them."""

    def feed(self, delta_text: str) -> StreamDelta:
        """Take the next piece of output; return what can be sent for it now. Text that may still
        turn out to be part of a tag or a call is held back until it resolves."""
        out = DeltaBuilder(self._trimmer)
        self._buffer += delta_text
        while self._advance(out):
            pass
        return out.build()

    def finish(self) -> StreamDelta:
        """The output has ended: return what was held back (e.g. "<tool_c" that never became a
        tag is content after all)."""
        out = DeltaBuilder(self._trimmer)
        self._flush(out)
        self._buffer = ""
        return out.build()

    @abstractmethod
    def _advance(self, out: DeltaBuilder) -> bool:
        """Resolve what can be resolved of ``self._buffer``; True to be called again."""

    @abstractmethod
    def _flush(self, out: DeltaBuilder) -> None:
        """Resolve the rest of ``self._buffer`` (and any call in progress) at the end."""

    def _new_call(self) -> CallStreamer:
        return CallStreamer(self._next_index, self.args_keys)

    def _feed_call(self, call: CallStreamer, out: DeltaBuilder) -> int | None:
        """Feeds the buffer to the call being read. None while its object is still open (the
        buffer is consumed); else the index in the buffer just past it (closed or broken)."""
        end = call.feed(self._buffer, out)
        if not (call.reader.done or call.reader.invalid):
            self._buffer = ""
            return None
        return end

    def _next_index(self) -> int:
        self._num_calls += 1
        return self._num_calls - 1
