"""Structured output and tool calling through the server, on the embedded SmolLM2-135M (its chat
template has no tool section: memwall renders the tool prompt and grammars enforce the calls).

The openai SDK's ``parse``, a tool-call round trip (streamed and not), LangChain's
``with_structured_output`` and ``bind_tools``, and the 400s; every body is checked against
OpenAI's published OpenAPI spec."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openapi_spec import CHAT_COMPLETION, CHAT_COMPLETION_CHUNK, COMPLETION, ERROR, check_sse_chunks, validate
from pydantic import BaseModel

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol_server(gguf_path, start_server):
    from memwall.entrypoints.openai.serving_chat import ToolSettings

    live = start_server(gguf_path, served_model_names=["smol"], tools=ToolSettings(True),
                            num_kv_blocks=512, max_model_len=2048, max_num_batched_tokens=1024,
                            threads=2)
    yield live
    live.stop()


def chat(server, **body) -> dict:
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 200,
                                                           "temperature": 0, **body})
    assert response.status_code == 200, response.text
    payload = response.json()
    validate(CHAT_COMPLETION, payload)
    return payload


def error(server, path: str = "/v1/chat/completions", **body) -> dict:
    with server.client() as http:
        response = http.post(path, json={"model": "smol", "max_tokens": 20, **body})
    assert response.status_code == 400, response.text
    payload = response.json()
    validate(ERROR, payload)
    return payload["error"]


# ---- structured output --------------------------------------------------------------------
class City(BaseModel):
    name: str
    country: str
    population: int


def test_openai_sdk_parse_returns_the_object(smol_server):
    import openai

    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused")
    completion = client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=200)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True, "schema": {
            "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
            "required": ["answer"], "additionalProperties": False}}}},
     lambda text: json.loads(text)["answer"] in ("yes", "no")),
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}}, lambda text: len(text) == 5 and text[2] == ":"),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda text: text in ("red", "green", "blue")),
], ids=["json_object", "json_schema", "regex", "choice"])
@pytest.mark.parametrize("stream", [False, True])
def test_constrained_chat(smol_server, body, check, stream):
    messages = [{"role": "user", "content": 'Is the sky blue? Reply with JSON like {"answer": "yes"}.'}]
    if not stream:
        choice = chat(smol_server, messages=messages, **body)["choices"][0]
        assert check(choice["message"]["content"]), choice
        assert choice["finish_reason"] == "stop"
        return
    with smol_server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "smol", "messages": messages, "max_tokens": 200, "temperature": 0,
            "stream": True, **body})
    events = check_sse_chunks(response.text, CHAT_COMPLETION_CHUNK)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert check(text), text
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_constrained_completion(smol_server):
    with smol_server.client() as http:
        response = http.post("/v1/completions", json={
            "model": "smol", "prompt": "The answer is", "max_tokens": 20, "temperature": 1.0,
            "n": 4, "seed": 1, "structured_outputs": {"regex": " (yes|no)!"}})
    assert response.status_code == 200, response.text
    validate(COMPLETION, response.json())
    assert {c["text"] for c in response.json()["choices"]} <= {" yes!", " no!"}


# ---- tool calling -------------------------------------------------------------------------
def _check_call(call: dict, tools=(WEATHER, TIME)) -> dict:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["type"] == "function" and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, schemas[call["function"]["name"]])
    return arguments


def streamed_chat(server, **body) -> tuple[str | None, list[dict], str]:
    """A streamed chat's content, its calls rebuilt from the deltas, and its finish reason."""
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "smol", "max_tokens": 200, "temperature": 0, "stream": True, **body})
    events = check_sse_chunks(response.text, CHAT_COMPLETION_CHUNK)
    content, calls = "", {}
    for event in events:
        for choice in event["choices"]:
            content += choice["delta"].get("content") or ""
            for piece in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": "function",
                                                         "function": {"name": None, "arguments": ""}})
                function = piece.get("function", {})
                call["function"]["name"] = function.get("name") or call["function"]["name"]
                call["function"]["arguments"] += function.get("arguments", "")
    return content or None, [calls[i] for i in sorted(calls)], events[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(smol_server, stream):
    """call -> tool result -> final answer, each turn streamed or not."""
    if stream:
        _, calls, finish = streamed_chat(smol_server, messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required")
    else:
        choice = chat(smol_server, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls"
    assert calls and all(_check_call(c) is not None for c in calls)
    # the tool's answer goes back; the model answers in words
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature": 18})}
        for c in calls]
    if stream:
        content, more_calls, finish = streamed_chat(smol_server, messages=history,
                                                    tools=[WEATHER, TIME], tool_choice="none")
        assert content and not more_calls and finish in ("stop", "length")
        return
    answer = chat(smol_server, messages=history, tools=[WEATHER, TIME], tool_choice="none")["choices"][0]
    assert answer["finish_reason"] in ("stop", "length") and answer["message"]["content"]
    assert "tool_calls" not in answer["message"]


def test_named_tool_choice_streams_openai_deltas(smol_server):
    with smol_server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "smol", "messages": ASK, "max_tokens": 200, "temperature": 0, "stream": True,
            "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    events = check_sse_chunks(response.text, CHAT_COMPLETION_CHUNK)
    pieces = [tc for e in events if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces, "no tool-call deltas were streamed"
    assert {p["index"] for p in pieces} == {0}
    named = [p for p in pieces if "id" in p]
    assert len(named) == 1 and named[0]["function"]["name"] == "get_weather"
    assert pieces[0] is named[0], "id and name come in the call's first delta"
    arguments = "".join(p.get("function", {}).get("arguments", "") for p in pieces)
    assert len([p for p in pieces if p.get("function", {}).get("arguments")]) > 1, "arguments in pieces"
    call = {"id": named[0]["id"], "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    assert _check_call(call)["unit"] in ("celsius", "fahrenheit")
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_and_plain_calls_agree(smol_server):
    body = dict(messages=ASK, tools=[WEATHER], tool_choice="required")
    plain = chat(smol_server, **body)["choices"][0]["message"]["tool_calls"]
    with smol_server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "smol", "max_tokens": 200, "temperature": 0, "stream": True, **body})
    events = check_sse_chunks(response.text, CHAT_COMPLETION_CHUNK)
    pieces = [tc for e in events if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    streamed = {}
    for piece in pieces:
        entry = streamed.setdefault(piece["index"], {"name": None, "arguments": ""})
        entry["name"] = piece.get("function", {}).get("name") or entry["name"]
        entry["arguments"] += piece.get("function", {}).get("arguments", "")
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in plain]


def test_auto_tool_choice_parses_what_the_model_writes(smol_server):
    body = chat(smol_server, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=120)
    message = body["choices"][0]["message"]
    for call in message.get("tool_calls", []):
        assert call["function"]["name"] and call["id"].startswith("call_")
    assert message.get("tool_calls") or message["content"] is not None


# ---- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
     "response_format", "dependentSchemas"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters", "strin"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
], ids=["unsupported-keyword", "no-schema", "bad-regex", "two-kinds", "unknown-key",
        "unknown-tool", "choice-without-tools", "bad-parameters", "format-and-tools"])
def test_bad_requests_are_400_with_param(smol_server, body, param, words):
    err = error(smol_server, messages=ASK, **body)
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("messages, words", [
    (ASK + [{"role": "tool", "content": "18C"}], "no tool_call_id"),
    (ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "18C"}], "no preceding"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"}], "not JSON"),
], ids=["no-id", "unknown-id", "bad-arguments"])
def test_invalid_tool_messages_are_400(smol_server, messages, words):
    err = error(smol_server, messages=messages, tools=[WEATHER])
    assert err["param"] == "messages" and words in err["message"], err


def test_auto_needs_the_server_flag(server):
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


def test_the_engine_is_clean_after_all_of_it(smol_server):
    smol_server.wait_idle()


# ---- LangChain ----------------------------------------------------------------------------
def _langchain(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smol",
                                       temperature=0, max_tokens=200)


def test_langchain_with_structured_output(smol_server):
    structured = _langchain(smol_server).with_structured_output(City)
    city = structured.invoke("Describe Paris as JSON.")
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools(smol_server):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = _langchain(smol_server).bind_tools([get_weather], tool_choice="get_weather")
    message = llm.invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)
