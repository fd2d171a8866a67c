"""52 JSON schemas of the kinds users send: nested objects, arrays, enums, anyOf, patterns,
numeric bounds, required vs optional properties, $ref/$defs, const, nullable values."""

from __future__ import annotations


def _obj(properties: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    schema = {"type": "object", "properties": properties,
              "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict] = [
    # flat objects, every primitive type
    _obj({"name": NAME, "age": {"type": "integer"}}),
    _obj({"title": NAME, "price": {"type": "number"}, "in_stock": {"type": "boolean"}}),
    _obj({"city": NAME, "population": {"type": "integer", "minimum": 0}}),
    _obj({"id": {"type": "integer"}, "label": NAME, "score": {"type": "number"}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"value": {"type": "null"}}),
    # numeric bounds
    _obj({"age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    _obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    _obj({"percent": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}),
    _obj({"count": {"type": "integer", "minimum": 1, "maximum": 5}, "unit": NAME}),
    _obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    _obj({"rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}),
    # enums and const
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"status": {"type": "string", "enum": ["open", "closed", "pending"]}, "id": {"type": "integer"}}),
    _obj({"kind": {"const": "person"}, "name": NAME}),
    _obj({"answer": {"enum": ["yes", "no", None, 42]}}),
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    # patterns and string lengths
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "note": NAME}),
    _obj({"slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 30}}),
    _obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
    _obj({"date": {"type": "string", "format": "date"}}),
    _obj({"email": {"type": "string", "format": "email", "maxLength": 40}}),
    _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    # arrays
    _obj({"tags": {"type": "array", "items": NAME, "maxItems": 4}}),
    _obj({"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}}),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                "maxItems": 3}, "maxItems": 3}}),
    _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3},
    {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
    _obj({"points": {"type": "array", "maxItems": 3,
                     "items": _obj({"x": {"type": "number"}, "y": {"type": "number"}})}}),
    _obj({"pair": {"type": "array", "prefixItems": [NAME, {"type": "integer"}], "items": False}}),
    # nested objects
    _obj({"person": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})}),
    _obj({"address": _obj({"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    _obj({"order": _obj({"id": {"type": "integer"},
                         "items": {"type": "array", "maxItems": 3,
                                   "items": _obj({"sku": NAME, "qty": {"type": "integer", "minimum": 1}})}})}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer"}})})})}),
    _obj({"meta": _obj({"version": {"type": "integer"}, "draft": {"type": "boolean"}}), "body": NAME}),
    # required vs optional
    _obj({"name": NAME, "nickname": NAME}, required=["name"]),
    _obj({"title": NAME, "subtitle": NAME, "year": {"type": "integer"}}, required=["title"]),
    _obj({"x": {"type": "integer"}, "y": {"type": "integer"}}, required=[]),
    _obj({"q": NAME, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, required=["q"]),
    # anyOf / oneOf / nullable
    _obj({"value": {"anyOf": [{"type": "integer"}, NAME]}}),
    _obj({"id": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}),
    _obj({"shape": {"anyOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "number"}}),
                              _obj({"kind": {"const": "square"}, "side": {"type": "number"}})]}}),
    _obj({"note": {"type": ["string", "null"], "maxLength": 20}}),
    {"anyOf": [_obj({"ok": {"const": True}, "data": NAME}),
               _obj({"ok": {"const": False}, "error": NAME})]},
    _obj({"item": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}),
    # $ref / $defs
    {"$defs": {"pt": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
     **_obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})},
    {"$defs": {"tag": {"type": "string", "enum": ["a", "b", "c"]}},
     **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}})},
    # open objects and top-level scalars
    _obj({"name": NAME}, closed=False) | {"maxProperties": 3},
    {"type": "integer", "minimum": -5, "maximum": 5},
]
