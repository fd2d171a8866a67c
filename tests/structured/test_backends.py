"""Both grammar backends against the embedded model's vocabulary: the bitmask allows exactly the
tokens that keep the output matching, drafts roll back, bad constraints fail with the reason."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from memwall import StructuredOutputsParams
from memwall.structured import GrammarError, VocabInfo, check, make_backend
from memwall.structured.schema import JSON_SAFE_INTEGER, with_integer_bounds

BACKEND_NAMES = ["llguidance", "xgrammar"]


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from memwall.loader.model_loader import load_tokenizer

    return load_tokenizer(str(gguf_path))


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return VocabInfo(tokenizer.backend, tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def backend(request, vocab):
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar backend is not installed")
    return make_backend(request.param, vocab)


def allowed(bitmask_row: np.ndarray, vocab_size: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_choice_mask_is_exactly_the_prefixes(backend, tokenizer, vocab):
    choices = ["Paris", "London", "Berlin"]
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(choice=choices)))
    first = allowed(grammar.bitmask()[0], vocab.vocab_size)
    assert first, "no token allowed at the start"
    for token in first:
        text = tokenizer.decode([token], skip_special_tokens=False)
        assert any(c.startswith(text) for c in choices), (token, text)
    # every choice's own first token is allowed
    for choice in choices:
        assert tokenizer.encode(choice, add_special_tokens=False)[0] in first


def test_walk_to_the_end_then_only_eos(backend, tokenizer, vocab):
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")))
    tokens = tokenizer.encode("123-ab", add_special_tokens=False)
    assert grammar.accept(tokens)
    end = allowed(grammar.bitmask()[0], vocab.vocab_size)
    assert end == set(vocab.eos_token_ids)
    # llguidance stops as soon as only EOS is left; xgrammar once EOS is taken
    assert grammar.accept([vocab.eos_token_ids[0]]) and grammar.is_terminated


def test_drafts_get_one_row_each_and_roll_back(backend, tokenizer, vocab):
    # no forced bytes: llguidance allows only the canonical token where the grammar forces text
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(regex=r"[a-c]{3}[0-9]+")))
    drafts = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "abc1"]
    assert grammar.valid_prefix(drafts + [drafts[0]]) == len(drafts) + 1 - 1  # 'a' after digits: no
    rows = grammar.bitmask(drafts)
    assert rows.shape == (len(drafts) + 1, vocab.bitmask_words)
    for j, token in enumerate(drafts):
        assert token in allowed(rows[j], vocab.vocab_size)
    # the state did not move: the first row again
    assert np.array_equal(grammar.bitmask()[0], rows[0])
    assert grammar.valid_prefix([drafts[3]]) == 0  # a digit cannot come first
    assert grammar.accept(drafts[:1])
    rows = grammar.bitmask([drafts[3], drafts[1]])  # a refused draft: nothing allowed after it
    assert not rows[1:].any() and rows[0].any()


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_bad_constraints_name_the_problem(name):
    if name == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar backend is not installed")
    with pytest.raises(GrammarError, match="strin"):
        check(StructuredOutputsParams(json={"type": "strin"}), name)
    with pytest.raises(GrammarError):
        check(StructuredOutputsParams(regex="(unclosed"), name)


def test_llguidance_names_an_unsupported_keyword():
    with pytest.raises(GrammarError, match="dependentSchemas"):
        check(StructuredOutputsParams(json={"type": "object", "dependentSchemas": {"a": {}}}))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of llguidance, xgrammar"):
        check(StructuredOutputsParams(regex="a"), "outlines")


def test_integers_get_json_safe_bounds_but_keep_the_users():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer", "minimum": 3},
        "c": {"type": ["integer", "null"]}, "d": {"enum": [{"type": "integer"}]}}}
    out = with_integer_bounds(schema)
    assert out["properties"]["a"] == {"type": "integer", "minimum": -JSON_SAFE_INTEGER,
                                      "maximum": JSON_SAFE_INTEGER}
    assert out["properties"]["b"]["minimum"] == 3
    assert out["properties"]["c"]["maximum"] == JSON_SAFE_INTEGER
    assert out["properties"]["d"] == {"enum": [{"type": "integer"}]}  # values are not schemas
    assert "minimum" not in schema["properties"]["a"]  # the caller's dict is untouched


def test_the_integer_bound_holds_in_the_grammar(backend, tokenizer, vocab):
    grammar = backend.new_grammar(backend.compile(StructuredOutputsParams(json={"type": "integer"})))
    digits = tokenizer.encode("9" * 17, add_special_tokens=False)
    assert grammar.valid_prefix(digits) < len(digits)
    ok = tokenizer.encode(str(JSON_SAFE_INTEGER), add_special_tokens=False)
    assert grammar.valid_prefix(ok) == len(ok)
    assert json.loads(str(JSON_SAFE_INTEGER)) == JSON_SAFE_INTEGER
    assert re.fullmatch(r"\d+", str(JSON_SAFE_INTEGER))
