"""Tool calling for /v1/chat/completions: checks, the prompt, the constraint, the parsing.

    resolve_tools()    tools + tool_choice + parallel_tool_calls -> ToolSetup (or a 400 naming
                       the param): which parser, whether the output is parsed, the constraint
    template_messages  the conversation as the chat template expects it: assistant tool calls
                       and tool results included; for a template without a tool section (the
                       embedded SmolLM2) memwall writes them, and the tool list, in Hermes form
    setup.constraint() "required" and named choices force the parser's format with a grammar
                       (memwall/structured/tool_grammar.py): even a 135M model returns calls
                       that parse, naming offered functions with arguments matching their schemas
    setup.parser()     a fresh parser (entrypoints/openai/tool_parsers/) per choice and stream

"auto" leaves the model free and parses what it writes; it needs ``--enable-auto-tool-choice``
as in vLLM (a model that was not trained for tools writes calls rarely and loosely).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from memwall.entrypoints.openai.errors import bad_request
from memwall.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from memwall.entrypoints.openai.tool_parsers import ToolParser, choose_tool_parser, get_tool_parser
from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.backend import GrammarError, check
from memwall.structured.tool_grammar import tool_call_constraint

# The tool section memwall renders where a chat template has none (Qwen2.5's wording).
HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
LLAMA3_TOOL_PROMPT = (
    "You have access to the following functions:\n{tools}\n\nTo call a function, respond with "
    'a JSON object of the form {{"name": function name, "parameters": dictionary of argument '
    "name and its value}}. Do not use variables.")


@dataclass
class ToolSetup:
    functions: list[dict]
    """The offered functions: [{"name", "description", "parameters"}]."""
    choice: str
    """"none", "auto", "required" or "named"."""
    named: str | None
    parser_name: str
    parallel: bool
    template_has_tools: bool
    """The chat template renders the tool list and tool messages itself."""

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def parser(self) -> ToolParser:
        return get_tool_parser(self.parser_name)()

    def constraint(self) -> StructuredOutputsParams | None:
        if self.choice == "required":
            return tool_call_constraint(self.functions, self.parser_name, self.parallel)
        if self.choice == "named":
            chosen = [f for f in self.functions if f["name"] == self.named]
            return tool_call_constraint(chosen, self.parser_name, parallel=False)
        return None

    def template_tools(self) -> list[dict] | None:
        if self.choice == "none" or not self.template_has_tools:
            return None
        return [{"type": "function", "function": f} for f in self.functions]


def template_has_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def resolve_tools(request: ChatCompletionRequest, template: str | None, auto_enabled: bool,
                  parser_name: str | None) -> ToolSetup | None:
    """None when the request offers no tools (then tool_choice may only be absent or "none")."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: give the functions the model may call",
                              "tool_choice")
        return None
    functions = [tool.function.model_dump(exclude_none=True) for tool in request.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request(f"two tools share a name: {names}", "tools")
    for index, function in enumerate(functions):
        _check_parameters(function, index)
    named = None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        named = choice.function.name
        if named not in names:
            raise bad_request(f"tool_choice names the function {named!r}, which is not among the "
                              f"tools ({', '.join(names)})", "tool_choice")
        choice = "named"
    if choice == "auto" and not auto_enabled:
        raise bad_request('"auto" tool choice needs the server started with '
                          "--enable-auto-tool-choice; or send tool_choice \"required\" or a named "
                          "function (enforced by a grammar)", "tool_choice")
    has_tools = template_has_tools(template)
    chosen = parser_name or choose_tool_parser(template if has_tools else None)
    return ToolSetup(functions, choice, named, chosen, request.parallel_tool_calls, has_tools)


def _check_parameters(function: dict, index: int) -> None:
    params = function.get("parameters")
    if params is None:
        return
    try:
        check(StructuredOutputsParams(json=params))
    except (GrammarError, ValueError) as e:
        raise bad_request(f"tools[{index}].function.parameters is not a usable JSON schema: {e}",
                          f"tools[{index}].function.parameters") from None


def template_messages(messages: list[ChatMessage], setup: ToolSetup | None) -> list[dict]:
    """The conversation for the chat template. Tool messages are checked against the calls
    they answer (400 with param "messages"); without a template tool section they are written
    in Hermes form: calls as <tool_call> blocks, results as <tool_response> user turns."""
    from memwall.entrypoints.openai.serving_engine import template_message

    native = setup is not None and setup.template_has_tools
    pending: dict[str, str] = {}  # call id -> function name, for the tool messages that follow
    out: list[dict] = []
    for index, message in enumerate(messages):
        entry = template_message(message)
        if message.role == "assistant" and message.tool_calls:
            calls = [_call_for_template(call, index) for call in message.tool_calls]
            pending = {call.id: call.function.name for call in message.tool_calls}
            if native:
                entry["tool_calls"] = calls
            else:
                blocks = "\n".join(_hermes_block(c["function"]) for c in calls)
                entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + blocks
        elif message.role == "tool":
            name = _answered_call(message, pending, index)
            if native:
                entry["tool_call_id"], entry["name"] = message.tool_call_id, name
            else:
                response = f"<tool_response>\n{entry['content']}\n</tool_response>"
                if messages[index - 1].role == "tool":  # one user turn holds all the results
                    out[-1]["content"] += "\n" + response
                    continue
                entry = {"role": "user", "content": response}
        out.append(entry)
    if setup is not None and setup.parses and not native:
        _add_tool_prompt(out, setup)
    return out


def _call_for_template(call, index: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except json.JSONDecodeError:
        raise bad_request(f"messages[{index}].tool_calls: the arguments of {call.function.name!r} "
                          "are not JSON text", "messages") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def _answered_call(message: ChatMessage, pending: dict[str, str], index: int) -> str:
    if not message.tool_call_id:
        raise bad_request(f"messages[{index}] has role 'tool' but no tool_call_id", "messages")
    if message.tool_call_id not in pending:
        raise bad_request(f"messages[{index}] answers tool call {message.tool_call_id!r}, which no "
                          "preceding assistant message made: a 'tool' message must follow the "
                          "assistant message whose tool_calls it answers", "messages")
    return pending[message.tool_call_id]


def _hermes_block(function: dict) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _add_tool_prompt(messages: list[dict], setup: ToolSetup) -> None:
    """The tool list as a system message (joined to the conversation's own system message)."""
    tools = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                      for f in setup.functions)
    template = LLAMA3_TOOL_PROMPT if setup.parser_name == "llama3_json" else HERMES_TOOL_PROMPT
    prompt = template.format(tools=tools)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
    else:
        messages.insert(0, {"role": "system", "content": prompt})
