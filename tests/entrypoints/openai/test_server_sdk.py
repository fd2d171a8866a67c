"""The official openai SDK against the live server: outputs equal the offline API's greedy ones."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from memwall import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):"]
GREEDY = dict(temperature=0, max_tokens=12)
EXTRA = {"ignore_eos": True}  # full-length outputs: more tokens compared


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def expected(offline, text_of):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [text_of(o.outputs[0]) for o in offline.generate(PROMPTS, params)]


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def expected_chat(offline, text_of):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [text_of(offline.chat(chat_messages(p), params)[0].outputs[0]) for p in PROMPTS]


def test_completions_equal_offline_greedy(client, expected, offline):
    out = client.completions.create(model="tiny", prompt=PROMPTS, extra_body=EXTRA, **GREEDY)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert all(c.finish_reason == "length" for c in out.choices)
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 12 * len(PROMPTS)
    assert out.usage.total_tokens == prompt_tokens + 12 * len(PROMPTS)
    assert out.object == "text_completion" and out.model == "tiny"


def test_token_id_prompts_equal_string_prompts(client, expected, offline):
    ids = [offline.tokenizer.encode(p) for p in PROMPTS]
    one = client.completions.create(model="tiny", prompt=ids[0], extra_body=EXTRA, **GREEDY)
    many = client.completions.create(model="tiny", prompt=ids, extra_body=EXTRA, **GREEDY)
    assert one.choices[0].text == expected[0]
    assert [c.text for c in many.choices] == expected


def test_completions_stream_equals_offline(client, expected):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=EXTRA, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_equals_offline(client, expected_chat):
    for prompt, want in zip(PROMPTS, expected_chat):
        out = client.chat.completions.create(model="tiny", messages=chat_messages(prompt),
                                             extra_body=EXTRA, **GREEDY)
        assert out.choices[0].message.content == want
        assert out.choices[0].message.role == "assistant"
        assert out.usage.completion_tokens == 12


def test_chat_stream_equals_offline(client, expected_chat):
    stream = client.chat.completions.create(model="tiny", messages=chat_messages(PROMPTS[1]),
                                            stream=True, extra_body=EXTRA, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_chat[1]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(client, expected_chat):
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": PROMPTS[2]}]}]
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                         max_completion_tokens=12, extra_body=EXTRA)
    assert out.choices[0].message.content == expected_chat[2]


def test_async_client_streams_concurrently(server, expected, expected_chat):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)

        async def complete(prompt):
            stream = await client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                     extra_body=EXTRA, **GREEDY)
            return "".join([c.choices[0].text async for c in stream])

        async def chat(prompt):
            out = await client.chat.completions.create(model="tiny", messages=chat_messages(prompt),
                                                       extra_body=EXTRA, **GREEDY)
            return out.choices[0].message.content

        texts = await asyncio.gather(*map(complete, PROMPTS), *map(chat, PROMPTS))
        await client.close()
        return texts

    assert asyncio.run(main()) == expected + expected_chat


def test_n_and_seed_are_reproducible(client):
    kwargs = dict(model="tiny", prompt=PROMPTS[0], n=3, temperature=1.0, seed=11, max_tokens=8,
                  extra_body=EXTRA)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 3 * 8


def test_stop_string_matches_offline(client, offline):
    full = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = full[0].outputs[0].text
    stop = text[5:8]
    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                       stop=[stop]))[0].outputs[0]
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=20,
                                    stop=stop, extra_body=EXTRA)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(client, expected, offline):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=3, echo=True,
                                    extra_body=EXTRA, **GREEDY)
    choice = out.choices[0]
    assert choice.text == PROMPTS[0] + expected[0]
    lp = choice.logprobs
    num_prompt = len(offline.tokenizer.encode(PROMPTS[0]))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 12
    assert lp.token_logprobs[0] is None  # the first prompt token is predicted by nothing
    generated = lp.token_logprobs[num_prompt:]
    assert all(isinstance(v, float) and v <= 0 for v in generated)
    for value, top in zip(generated, lp.top_logprobs[num_prompt:]):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy took the top token
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_logprobs_stream(client, expected):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=2, stream=True,
                                            extra_body=EXTRA, **GREEDY))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) == 12 and "".join(tokens) == expected[0]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=chat_messages(PROMPTS[0]), logprobs=True,
                                         top_logprobs=2, extra_body=EXTRA, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert item.bytes == list(item.token.encode())


def test_continuous_usage_stats(server):
    body = {"model": "tiny", "prompt": PROMPTS[0], "stream": True, "max_tokens": 5, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with server.client() as http:
        lines = [l for l in http.post("/v1/completions", json=body).text.splitlines() if l]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(l[len("data: "):]) for l in lines[:-1]]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5


def test_models_health_version_tokenize(server, client, offline):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == offline.tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": chat_messages("hi")}).json()
    assert chat["tokens"] == offline.render_chat(chat_messages("hi"))
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(schema["paths"])
