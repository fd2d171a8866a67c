"""The grammar that makes a model call tools: ``tool_choice`` "required" or a named function.

The output is forced into the chosen parser's format, with each call's JSON matching one of the
offered functions (its name a constant, its arguments the function's ``parameters`` schema), so
even a 135M model returns calls that parse and validate. Written in llguidance's Lark, which
embeds JSON schemas (``%json {...}``):

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one or more)
    llama3_json  {"name": "f", "parameters": {...}}                             (";"-separated)
"""

from __future__ import annotations

import json

from memwall.sampling_params import StructuredOutputsParams
from memwall.structured.schema import with_integer_bounds

FORMATS = ("hermes", "llama3_json")


def call_schema(name: str, parameters: dict | None, arguments_key: str = "arguments") -> dict:
    """One call's JSON: the function's name as a constant and its parameters' schema."""
    params = with_integer_bounds(parameters) if parameters else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def tool_call_constraint(functions: list[dict], parser: str, parallel: bool) -> StructuredOutputsParams:
    """``functions``: [{"name", "parameters"}] the model must choose from (one for a named
    choice); ``parallel``: one call or several."""
    if parser not in FORMATS:
        raise ValueError(f"no tool-call grammar for the {parser!r} format; known: {', '.join(FORMATS)}")
    key = "arguments" if parser == "hermes" else "parameters"
    schemas = [call_schema(f["name"], f.get("parameters"), key) for f in functions]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if parser == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        call = "call: body"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    lark = f"{start}\n{call}\nbody: %json {json.dumps(body)}\n"
    return StructuredOutputsParams(grammar=lark, backend="llguidance")
