"""Model output text -> OpenAI tool calls, for complete outputs and for streams.

Reading order: base.py (the shapes, the ToolParser interface, the streaming JSON machinery) ->
hermes.py (<tool_call> tags: Hermes, Qwen2.5) -> llama3_json.py (bare JSON: Llama 3.x).

    parser = get_tool_parser(choose_tool_parser(chat_template))()
    parser.extract(text)                      # a complete output
    parser.feed(piece) ... parser.finish()    # a stream: one parser per stream
"""

from __future__ import annotations

from memwall.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_tool_call_id,
)
from memwall.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from memwall.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
           "StreamDelta", "ToolCall", "ToolCallDelta", "ToolParser", "choose_tool_parser",
           "get_tool_parser", "new_tool_call_id"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def choose_tool_parser(chat_template: str | None) -> str:
    """The parser matching the format a chat template teaches its model.

    A template that renders tools names its format ("<tool_call>" for Hermes and Qwen2.5, the
    python tag or the "ipython" role for Llama 3.1). A template without tools gets "hermes":
    memwall then renders its own Hermes-style tool prompt, so the model answers in that format.
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"
