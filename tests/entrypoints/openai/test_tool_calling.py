"""Tool requests without a server: checks, parser choice, and the conversation a chat template
gets, for templates with a tool section (Qwen2.5-like, Llama-3.1-like) and without one."""

from __future__ import annotations

import json

import pytest

from memwall.entrypoints.openai.errors import APIError
from memwall.entrypoints.openai.protocol import ChatCompletionRequest
from memwall.entrypoints.openai.tool_calling import resolve_tools, template_messages
from memwall.tokenizer.chat_template import render_chat_template

QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nanswer in <tool_call></tool_call> tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for tc in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_LIKE = ("{% if tools %}Tools: {{ tools | tojson }} <|python_tag|>{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": HISTORY, "tools": [WEATHER], **body})


def render(template: str, req: ChatCompletionRequest, setup) -> str:
    return render_chat_template(template, template_messages(req.messages, setup), bos_token="",
                                eos_token="", add_generation_prompt=True,
                                tools=setup.template_tools() if setup else None)


def test_a_template_with_tools_renders_them_itself():
    req = request(tool_choice="required")
    setup = resolve_tools(req, QWEN_LIKE, auto_enabled=False, parser_name=None)
    assert setup.parser_name == "hermes" and setup.template_has_tools
    text = render(QWEN_LIKE, req, setup)
    assert '"name": "get_weather"' in text and "<tools>" in text
    # arguments reach the template as an object, not as a JSON string inside JSON
    assert '"arguments": {"city": "Paris"}' in text
    assert "<tool_response>\n18C\n</tool_response>" in text


def test_llama_templates_get_the_llama_parser_and_its_grammar():
    setup = resolve_tools(request(tool_choice="required"), LLAMA_LIKE, auto_enabled=False,
                          parser_name=None)
    assert setup.parser_name == "llama3_json"
    assert '"parameters"' in setup.constraint().grammar


def test_a_template_without_tools_gets_memwalls_prompt_and_history():
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    setup = resolve_tools(req, CHATML, auto_enabled=False, parser_name=None)
    assert not setup.template_has_tools and setup.template_tools() is None
    text = render(CHATML, req, setup)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response>" in text


def test_tool_choice_none_renders_no_tools_but_keeps_the_history():
    req = request(tool_choice="none")
    setup = resolve_tools(req, CHATML, auto_enabled=False, parser_name=None)
    assert not setup.parses and setup.constraint() is None
    text = render(CHATML, req, setup)
    assert "# Tools" not in text and "<tool_response>" in text


def test_parallel_false_means_one_call():
    setup = resolve_tools(request(tool_choice="required", parallel_tool_calls=False), CHATML,
                          auto_enabled=False, parser_name=None)
    grammar = setup.constraint().grammar
    assert grammar.startswith("start: call\n")


@pytest.mark.parametrize("body, param", [
    (dict(tool_choice="auto"), "tool_choice"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "tools"),
])
def test_refusals(body, param):
    with pytest.raises(APIError) as info:
        resolve_tools(request(**body), CHATML, auto_enabled=False, parser_name=None)
    assert info.value.status == 400 and info.value.param == param
