"""Tool parsers: extract() on complete outputs against hand-written answers, and streams checked
against extract() with the text cut every possible way (1-character pieces, every two-piece
split, seeded random chunks). OpenAI's streaming rules are checked on every stream: a call's id
and name come once, in its first delta; indexes run 0..n-1; arguments pieces concatenate to the
arguments extract() finds; content concatenates to extract()'s content.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from memwall.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolParser,
    choose_tool_parser,
    get_tool_parser,
    new_tool_call_id,
)
from memwall.entrypoints.openai.tool_parsers.base import JsonValueScanner

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC", "format": 24}}'
# Strings with braces, brackets, quotes, escapes and non-ASCII text; numbers, literals, nesting.
NESTED_ARGS = {"query": 'a {b} [c] "quoted" \\ back\nslash\t} ]', "emoji": "日本語 é 😀",
               "filters": {"tags": ["x", "y}", "{z"], "range": {"lo": -1.5e3, "hi": None},
                           "ok": True, "empty": {}, "list": [[], [1, [2, {"k": "}"}]]]}}
NESTED = json.dumps({"name": "search", "arguments": NESTED_ARGS})
NESTED_ESCAPED = json.dumps({"name": "search", "arguments": NESTED_ARGS}, ensure_ascii=True)
STRING_ARGS = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})


def block(obj_text: str, before: str = "\n", after: str = "\n") -> str:
    return f"<tool_call>{before}{obj_text}{after}</tool_call>"


PARIS = ("get_weather", {"city": "Paris"})
HERMES_CASES = {
    "single": (block(WEATHER), None, [PARIS]),
    "two": (block(WEATHER) + "\n" + block(TIME), None,
            [PARIS, ("get_time", {"tz": "UTC", "format": 24})]),
    "two_tight": (block(WEATHER, "", "") + block(WEATHER, " \n\n ", "  "), None, [PARIS, PARIS]),
    "content_before": ("Let me check the weather.\n" + block(WEATHER),
                       "Let me check the weather.", [PARIS]),
    "content_between_and_after": ("A " + block(WEATHER) + " B\n" + block(WEATHER) + " C",
                                  "A  B\n C", [PARIS, PARIS]),
    "no_calls": ("Paris is the capital of France. a < b, <b>bold</b>, <tool",
                 "Paris is the capital of France. a < b, <b>bold</b>, <tool", []),
    "partial_tag_at_end": ("Hello <tool_c", "Hello <tool_c", []),
    "malformed_json": ("Hi " + block("{name: get_weather}") + " there",
                       "Hi " + block("{name: get_weather}") + " there", []),
    "not_an_object": (block('["get_weather"]'), block('["get_weather"]'), []),
    "no_name": (block('{"arguments": {"city": "Paris"}}'),
                block('{"arguments": {"city": "Paris"}}'), []),
    "no_name_tag_in_string": (block('{"arguments": {"t": "</tool_call>"}}'),
                              block('{"arguments": {"t": "</tool_call>"}}'), []),
    "name_not_string": (block('{"name": 42, "arguments": {}}'),
                        block('{"name": 42, "arguments": {}}'), []),
    "bad_value_before_name": (block('{"arguments": {"a": tru}, "name": "f"}'),
                              block('{"arguments": {"a": tru}, "name": "f"}'), []),
    "malformed_then_call": (block("oops") + "\n" + block(WEATHER), block("oops"), [PARIS]),
    "nested": (block(NESTED), None, [("search", NESTED_ARGS)]),
    "nested_ascii_escapes": (block(NESTED_ESCAPED), None, [("search", NESTED_ARGS)]),
    "arguments_string": (block(STRING_ARGS), None, [PARIS]),
    "arguments_missing": (block('{"name": "get_time"}'), None, [("get_time", {})]),
    "arguments_before_name": (block('{"arguments": {"city": "Paris"}, "name": "get_weather"}'),
                              None, [PARIS]),
    "tags_inside_strings": (
        block('{"name": "echo", "arguments": {"t": "</tool_call><tool_call>"}}'),
        None, [("echo", {"t": "</tool_call><tool_call>"})]),
    "unclosed_last_block": ("Sure.\n<tool_call>\n" + WEATHER + "\n", "Sure.", [PARIS]),
    "unclosed_malformed": ("Sure.\n<tool_call>\n{\"name\"", 'Sure.\n<tool_call>\n{"name"', []),
}

LLAMA_CASES = {
    "single": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    "python_tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                   None, [PARIS]),
    "arguments_key": (WEATHER, None, [PARIS]),
    "two_semicolon": (WEATHER + "; " + TIME, None,
                      [PARIS, ("get_time", {"tz": "UTC", "format": 24})]),
    "two_newline": ("\n\n" + WEATHER + "\n" + WEATHER + "\n", None, [PARIS, PARIS]),
    "content_before_call": ("Sure! " + WEATHER, "Sure! " + WEATHER, []),
    "no_calls": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "partial_tag_only": ("<|python", "<|python", []),
    "tag_then_text": ("<|python_tag|>print('hi')", "print('hi')", []),
    "malformed_json": ('{"name": get_weather}', '{"name": get_weather}', []),
    "no_name": ('{"parameters": {"city": "Paris"}}', '{"parameters": {"city": "Paris"}}', []),
    "call_then_text": (WEATHER + " Done.", "Done.", [PARIS]),
    "call_then_malformed": (WEATHER + ";{oops}", "{oops}", [PARIS]),
    "nested": (NESTED, None, [("search", NESTED_ARGS)]),
    "nested_ascii_escapes": ("<|python_tag|>" + NESTED_ESCAPED, None, [("search", NESTED_ARGS)]),
    "arguments_string": (STRING_ARGS, None, [PARIS]),
    "parameters_missing": ('{"name": "get_time"}', None, [("get_time", {})]),
}

ALL_CASES = ([(HermesToolParser, text) for text, _, _ in HERMES_CASES.values()]
             + [(Llama3JsonToolParser, text) for text, _, _ in LLAMA_CASES.values()])
ALL_IDS = [f"hermes-{k}" for k in HERMES_CASES] + [f"llama3-{k}" for k in LLAMA_CASES]


# ---- complete outputs ----

@pytest.mark.parametrize("parser_cls, cases", [(HermesToolParser, HERMES_CASES),
                                               (Llama3JsonToolParser, LLAMA_CASES)],
                         ids=["hermes", "llama3_json"])
def test_extract(parser_cls: type[ToolParser], cases: dict) -> None:
    for case, (text, content, calls) in cases.items():
        got = parser_cls().extract(text)
        assert got.content == content, case
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, case
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got.tool_calls), case


def test_arguments_string_is_used_as_is() -> None:
    text = block(json.dumps({"name": "f", "arguments": '{"a": [1, 2]}'}))
    assert HermesToolParser().extract(text).tool_calls[0].arguments == '{"a": [1, 2]}'


def test_call_ids_are_unique() -> None:
    ids = {new_tool_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# ---- streams ----

def run_stream(parser_cls: type[ToolParser], pieces: list[str]) -> tuple[str, list[tuple]]:
    """Feed the pieces, check OpenAI's delta rules, return (content, [(name, args text)])."""
    parser = parser_cls()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, calls = "", {}  # index -> [id, name, arguments]
    for delta in deltas:
        content += delta.content or ""
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, f"first delta lacks id/name: {d}"
                assert d.index == len(calls), f"index {d.index} out of order"
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None, f"id/name sent twice: {d}"
            calls[d.index][2] += d.arguments or ""
    assert parser.num_calls == len(calls)
    assert len({c[0] for c in calls.values()}) == len(calls)
    return content, [(name, args) for _, name, args in calls.values()]


def assert_stream_matches_extract(parser_cls: type[ToolParser], text: str,
                                  pieces: list[str]) -> None:
    assert "".join(pieces) == text
    expected = parser_cls().extract(text)
    content, calls = run_stream(parser_cls, pieces)
    assert content.strip() == (expected.content or ""), pieces
    assert [name for name, _ in calls] == [c.name for c in expected.tool_calls], pieces
    for (_, args), call in zip(calls, expected.tool_calls, strict=True):
        assert json.loads(args) == json.loads(call.arguments), pieces


def random_pieces(text: str, seed: int) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        pieces.append(text[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("parser_cls, text", ALL_CASES, ids=ALL_IDS)
def test_stream_whole_and_one_char_pieces(parser_cls: type[ToolParser], text: str) -> None:
    assert_stream_matches_extract(parser_cls, text, [text])
    assert_stream_matches_extract(parser_cls, text, list(text))


@pytest.mark.parametrize("parser_cls, text", ALL_CASES, ids=ALL_IDS)
def test_stream_every_two_piece_split(parser_cls: type[ToolParser], text: str) -> None:
    for cut in range(len(text) + 1):
        assert_stream_matches_extract(parser_cls, text, [text[:cut], text[cut:]])


@pytest.mark.parametrize("parser_cls, text", ALL_CASES, ids=ALL_IDS)
def test_stream_random_chunks(parser_cls: type[ToolParser], text: str) -> None:
    for seed in range(20):
        assert_stream_matches_extract(parser_cls, text, random_pieces(text, seed))


FRAGMENTS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<tool_", "{", "}", "[", "]",
             '"', "\\", ":", ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"',
             '"f"', "1", "tru", "null", "é", "text", WEATHER, block(WEATHER)]


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser])
def test_stream_fuzz_keeps_the_delta_rules(parser_cls: type[ToolParser]) -> None:
    """Random fragment soup: streams may differ from extract() on objects that break after
    their name (see base.py), but never crash or break OpenAI's delta rules."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30)))
        parser_cls().extract(text)
        run_stream(parser_cls, random_pieces(text, rng.randint(0, 10**6)))
        run_stream(parser_cls, list(text))


def test_stream_sends_content_before_the_tag_resolves() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hello <tool").content == "Hello"  # the space is held: it may end the text
    assert parser.feed("s are fun").content == " <tools are fun"
    assert parser.finish().content is None


def test_stream_arguments_arrive_in_pieces_and_stop_at_their_end() -> None:
    parser = HermesToolParser()
    first = parser.feed('<tool_call>\n{"name": "get_weather", "argu')
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "get_weather", None)]
    assert parser.feed('ments": {"city": "Pa').tool_calls[0].arguments == '{"city": "Pa'
    assert parser.feed('ris"}}\n</tool_call>').tool_calls[0].arguments == 'ris"}'
    assert parser.finish().tool_calls == []


def test_stream_cut_off_after_the_name_keeps_the_call() -> None:
    """A stream cannot take back a call it started; with no arguments sent, they are "{}"."""
    parser = HermesToolParser()
    assert parser.feed('<tool_call>{"name": "get_time"').tool_calls[0].name == "get_time"
    assert [d.arguments for d in parser.finish().tool_calls] == ["{}"]


def test_llama3_plain_text_streams_as_content_at_once() -> None:
    parser = Llama3JsonToolParser()
    assert parser.feed("The capital").content == "The capital"
    assert parser.feed(" is Paris.").content == " is Paris."


def test_scanner_stops_at_the_end_of_a_value() -> None:
    for value, rest in [('{"a": "}\\"{", "b": [1, {}]}', '}, "x": 1}'), ('"q\\"}"', ", 1"),
                        ("-12.5e3", "}"), ("true", " ,"), ("[[], [{}]]", "]")]:
        scanner = JsonValueScanner()
        end = sum(scanner.feed(ch) for ch in value + rest if not scanner.done)
        assert scanner.done and end == len(value), value


# ---- registry ----

QWEN25_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{% for tool in "
                   "tools %}{{ tool | tojson }}{% endfor %}</tools>\\nFor each function call, "
                   "return a json object within <tool_call></tool_call> XML tags{%- endif %}")
LLAMA31_TEMPLATE = ("{%- if message.role == 'assistant' and message.tool_calls %}"
                    "{{- '<|python_tag|>' + tool_call.function.name }}{%- elif message.role == "
                    "'tool' or message.role == 'ipython' %}{{- '<|start_header_id|>ipython' }}"
                    "{%- endif %}")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                   "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")


def test_choose_tool_parser() -> None:
    assert choose_tool_parser(QWEN25_TEMPLATE) == "hermes"
    assert choose_tool_parser(LLAMA31_TEMPLATE) == "llama3_json"
    ipython_only = "{{ '<|start_header_id|>ipython<|end_header_id|>' }}"
    assert choose_tool_parser(ipython_only) == "llama3_json"
    assert choose_tool_parser(CHATML_TEMPLATE) == "hermes"
    assert choose_tool_parser(None) == "hermes"


def test_get_tool_parser() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError) as err:
        get_tool_parser("mistral")
    message = str(err.value)
    assert "mistral" in message and "hermes" in message and "llama3_json" in message
    assert "\n" not in message
