"""Rendering chat templates: the Jinja programs models ship to turn messages into a prompt.

A chat template is code from the internet, so it runs in Jinja's immutable sandbox, with the same
helpers Hugging Face gives templates (`raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape), so that a template renders here exactly as it does in transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from memwall.tokenizer.tokenizer import TokenizerError

NO_TEMPLATE_MESSAGE = (
    "this model has no chat template; pass a prompt instead or supply a chat template for it"
)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but touching an unsafe attribute fails at once.

    Jinja's sandbox answers `''.__class__` with an undefined value that renders as "" and only
    complains when used further; we would rather stop the template right there.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it; we just render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compiling is the slow part of rendering; a server renders the same template on every request."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc


def _text_of(content: Any, role: str) -> Any:
    """Content parts [{"type": "text", "text": ...}, ...] joined into one string, with newlines.

    Text-only templates concatenate `message['content']` as a string, so parts must become one.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise TokenizerError(f"a {role} message has a content part of type {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _plain(value: Any) -> Any:
    """A copy built from JSON types only, so the template cannot reach methods of caller objects."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _prepare_messages(messages: list[dict]) -> list[dict]:
    prepared = []
    for message in messages:
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise TokenizerError(f"chat messages must be objects with 'role' and 'content', got {kind}")
        message = _plain(message)
        if "content" in message:
            message["content"] = _text_of(message["content"], message.get("role", "?"))
        prepared.append(message)
    return prepared


def render_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool,
    tools=None,
    **extra: Any,
) -> str:
    """Render `template` for `messages`, as transformers' `apply_chat_template(tokenize=False)` would.

    Raises TokenizerError when there is no template, when it does not parse, when it calls
    `raise_exception`, or when it tries to break out of the sandbox.
    """
    if not template:
        raise TokenizerError(NO_TEMPLATE_MESSAGE)
    compiled = _compile(template)
    context = {
        **_plain(extra),
        "messages": _prepare_messages(messages),
        "tools": _plain(tools),
        "documents": _plain(extra.get("documents")),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    try:
        return compiled.render(**context)
    except jinja2.exceptions.SecurityError as exc:
        raise TokenizerError(f"chat template blocked by the sandbox: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"chat template error: {exc}") from exc
    except TokenizerError:
        raise
    except Exception as exc:  # template code doing e.g. str + None: still the template's problem
        raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
