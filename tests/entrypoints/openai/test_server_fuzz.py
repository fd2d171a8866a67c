"""Fuzzing both POST endpoints (and the tokenizer routes) with hypothesis: never a 5xx.

Bodies mix well-typed requests with values anywhere in their ranges (these reach the sampler),
hostile ones with extreme or wrongly typed values in every field, arbitrary JSON and raw bytes.
Generation is kept short (max_tokens is small or invalid) so the few hundred examples finish in
seconds on the tiny model.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BIG = st.sampled_from([2**31, 2**63, 2**64, 10**30, -(2**63) - 1])
ints = st.one_of(st.integers(-3, 40), BIG)
floats = st.one_of(st.floats(-5, 5, allow_nan=False), st.sampled_from([0.0, 1e-300, 1e300, -1e300]))
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(-2, 3), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
tokens = st.lists(st.one_of(st.integers(-2, 400), BIG), min_size=0, max_size=8)
text = st.text(max_size=40)
prompts = st.one_of(text, tokens, st.lists(text, max_size=3), st.lists(tokens, max_size=3), junk)
content = st.one_of(text, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", ""]), "text": st.one_of(text, junk)}), max_size=2), junk)
messages = st.one_of(st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "x"]),
     "content": content}), max_size=3), junk)
# Never null: that means "up to the context window", hundreds of tokens per example.
max_tokens = st.one_of(st.integers(-2, 6), BIG, st.text(max_size=3), st.booleans(), st.floats(0, 9))

SAMPLING_FIELDS = {
    "model": st.one_of(st.just("tiny"), text, junk),
    "n": st.one_of(st.integers(-1, 4), BIG, junk),
    "temperature": st.one_of(floats, junk), "top_p": st.one_of(floats, junk),
    "top_k": st.one_of(ints, junk), "min_p": st.one_of(floats, junk),
    "repetition_penalty": st.one_of(floats, junk),
    "presence_penalty": floats, "frequency_penalty": floats,
    "seed": st.one_of(ints, junk), "stop": st.one_of(text, st.lists(text, max_size=3), junk),
    "stop_token_ids": st.one_of(tokens, junk), "min_tokens": st.one_of(ints, junk),
    "ignore_eos": st.one_of(st.booleans(), junk), "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}), junk),
    "user": st.one_of(text, junk), "skip_special_tokens": st.one_of(st.booleans(), junk),
    "include_stop_str_in_output": st.booleans(),
}
completion_body = st.fixed_dictionaries(
    {"prompt": prompts, "max_tokens": max_tokens},
    optional={**SAMPLING_FIELDS, "logprobs": st.one_of(ints, junk), "echo": st.one_of(st.booleans(), junk),
              "suffix": st.one_of(st.none(), text)})
chat_body = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": max_tokens},
    optional={**SAMPLING_FIELDS, "logprobs": st.one_of(st.booleans(), junk),
              "top_logprobs": st.one_of(ints, junk), "max_completion_tokens": max_tokens,
              "add_generation_prompt": st.booleans()})
scalars = st.one_of(st.none(), st.booleans(), st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
# Well-typed bodies with values anywhere in their documented ranges: these reach the sampler.
vocab_ids = st.lists(st.integers(0, 383), min_size=1, max_size=8)
VALID_FIELDS = {
    "model": st.sampled_from(["tiny", "tiny-alias"]), "n": st.integers(1, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-1, 1000), st.just(2**62)),
    "repetition_penalty": st.floats(0.01, 100), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3), "min_tokens": st.integers(0, 6),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(),
                                             "continuous_usage_stats": st.booleans()}),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30), vocab_ids,
                         st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                         st.lists(vocab_ids, min_size=1, max_size=3)),
     "max_tokens": st.integers(1, 6)},
    optional={**VALID_FIELDS, "logprobs": st.integers(0, 20), "echo": st.booleans()})
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(st.text(max_size=30), st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=2))})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(valid_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
    optional={**VALID_FIELDS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)})

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
request = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_completion),
    st.tuples(st.just("/v1/chat/completions"), valid_chat),
    st.tuples(st.just("/v1/completions"), completion_body),
    st.tuples(st.just("/v1/chat/completions"), chat_body),
    st.tuples(st.sampled_from(["/tokenize"]), st.one_of(
        st.fixed_dictionaries({"prompt": prompts}), st.fixed_dictionaries({"messages": messages}))),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({"tokens": st.one_of(tokens, junk)})),
    st.tuples(st.sampled_from(ROUTES), any_json),
    st.tuples(st.sampled_from(ROUTES), st.binary(max_size=20)),
)


STATUSES: Counter = Counter()


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=60) as client:
        yield client


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=request)
def test_no_request_body_makes_a_5xx(http, case):
    path, body = case
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    STATUSES[(path, response.status_code)] += 1
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert '"error"' not in response.text, (path, body, response.text)  # no in-band failure
        assert response.text.rstrip().endswith("data: [DONE]")


def test_engine_survived_the_fuzzing(server):
    # The fuzzing reached the engine, not only the validators.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert STATUSES[(path, 200)] >= 10, STATUSES
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
