"""Chat template rendering: HF-compatible helpers, content parts, and the sandbox."""

from __future__ import annotations

import pytest

from memwall.tokenizer import TokenizerError, render_chat_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render(template: str, messages=(), **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return render_chat_template(template, list(messages), bos_token="<s>", eos_token="</s>", **kwargs)


def test_chatml_with_and_without_generation_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert render(CHATML, messages, add_generation_prompt=False) == expected
    assert render(CHATML, messages) == expected + "<|im_start|>assistant\n"


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = render(CHATML, [{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"


def test_caller_messages_are_not_changed() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "x"}]}
    render(CHATML, [message])
    assert message["content"] == [{"type": "text", "text": "x"}]


def test_non_text_parts_are_rejected() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(TokenizerError, match="image_url"):
        render(CHATML, [{"role": "user", "content": parts}])


def test_special_tokens_tools_and_extra_variables() -> None:
    template = (
        "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}{{ eos_token }}"
    )
    tools = [{"type": "function", "function": {"name": "f", "description": "ü <b>"}}]
    out = render(template, tools=tools, enable_thinking=False)
    # HF's tojson: no HTML escaping and no ASCII escaping, spaces after separators
    assert out == '<s>[{"type": "function", "function": {"name": "f", "description": "ü <b>"}}]/no_think</s>'


def test_hf_helpers_and_jinja_features() -> None:
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    assert render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "012"
    assert render("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                  "{{ ns.n }}", [{"role": "user", "content": "a"}] * 3) == "3"
    assert render("{% generation %}kept{% endgeneration %}") == "kept"
    # trim_blocks / lstrip_blocks: block tags leave no blank lines behind
    assert render("  {% if true %}\nyes\n  {% endif %}\n") == "yes\n"


def test_raise_exception_becomes_a_tokenizer_error() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}"
    with pytest.raises(TokenizerError, match="roles must start with user"):
        render(template, [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append(1) %}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_blocks_escapes(escape: str) -> None:
    with pytest.raises(TokenizerError, match="blocked by the sandbox"):
        render(escape, [{"role": "user", "content": "x"}])


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(TokenizerError, match="no chat template; pass a prompt instead"):
        render_chat_template(None, [], bos_token="", eos_token="", add_generation_prompt=True)


def test_syntax_error_is_a_tokenizer_error() -> None:
    with pytest.raises(TokenizerError, match="does not parse"):
        render("{% for m in messages %}")


def test_template_runtime_error_is_a_tokenizer_error() -> None:
    with pytest.raises(TokenizerError, match="chat template"):
        render("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])


def test_compiled_templates_are_cached() -> None:
    from memwall.tokenizer.chat_template import _compile

    render(CHATML)
    before = _compile.cache_info().hits
    render(CHATML)
    assert _compile.cache_info().hits == before + 1
