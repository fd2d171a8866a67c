"""JSON-schema preparation shared by the backends.

Integers without bounds get JSON's exact range, +-(2**53 - 1): the integers every JSON parser
(JavaScript's included) reads without loss. Unbounded, a grammar allows a number of any length,
and a small model under greedy decoding can repeat digits until max_tokens, so the output is cut
and never parses. The user's bounds, where given, are kept as they are.
"""

from __future__ import annotations

from typing import Any

JSON_SAFE_INTEGER = 2**53 - 1


def with_integer_bounds(schema: Any) -> Any:
    """A copy of ``schema`` whose integer schemas without a lower or upper bound get one."""
    if isinstance(schema, list):
        return [with_integer_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in ("const", "enum", "default", "examples") else with_integer_bounds(value))
           for key, value in schema.items()}
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -JSON_SAFE_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = JSON_SAFE_INTEGER
    return out
