"""The tool-call grammar: the parser's format, offered names only, arguments per schema."""

from __future__ import annotations

import pytest

from memwall.structured import make_backend
from memwall.structured.tool_grammar import tool_call_constraint
from tests.structured.test_backends import tokenizer, vocab  # noqa: F401 - fixtures

FUNCTIONS = [{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time"}]


def walk(backend, constraint, tokenizer, text: str) -> bool:
    grammar = backend.new_grammar(backend.compile(constraint))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return grammar.valid_prefix(ids) == len(ids)


@pytest.fixture(scope="module")
def llg(vocab):  # noqa: F811
    return make_backend("llguidance", vocab)


def test_hermes_calls(llg, tokenizer):  # noqa: F811
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    parallel = tool_call_constraint(FUNCTIONS, "hermes", parallel=True)
    single = tool_call_constraint(FUNCTIONS, "hermes", parallel=False)
    assert walk(llg, parallel, tokenizer, two)
    assert walk(llg, single, tokenizer, one) and not walk(llg, single, tokenizer, two)
    assert not walk(llg, parallel, tokenizer, one.replace("get_weather", "get_wether"))
    assert not walk(llg, parallel, tokenizer, one.replace('"city"', '"town"'))
    assert not walk(llg, parallel, tokenizer, "Sure! " + one)


def test_llama3_json_calls(llg, tokenizer):  # noqa: F811
    constraint = tool_call_constraint(FUNCTIONS[:1], "llama3_json", parallel=False)
    assert walk(llg, constraint, tokenizer, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not walk(llg, constraint, tokenizer, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')


def test_unknown_format():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_call_constraint(FUNCTIONS, "mistral", parallel=True)
