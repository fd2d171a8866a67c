"""StructuredOutputsParams: exactly one constraint, checked shapes, a key for the compile cache."""

from __future__ import annotations

import pytest

from memwall import SamplingParams, StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a+", choice=["a"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json="[1, 2]"), "must be a JSON schema object"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty list"),
    (dict(regex=""), "non-empty string"),
])
def test_bad_shapes_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_json_text_is_parsed_and_keys_ignore_key_order():
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.kind == "json" and isinstance(a.json, dict)
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json={"type": "object"}).key
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_refuses_other_types():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
