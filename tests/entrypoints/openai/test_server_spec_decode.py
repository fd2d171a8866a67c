"""`memwall serve --speculative-config`: the server answers exactly what it answers without
speculation (streamed and not), counts drafts on /metrics, and refuses a bad config at start."""

from __future__ import annotations

import json
import random

import pytest

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


@pytest.fixture(scope="module")
def spec_server(model_dir, start_server):
    # the engine core in its own process: the config crosses to it as `memwall serve` sends it
    live = start_server(model_dir, core_process=True, speculative_config=NGRAM)
    yield live
    live.stop()


def _stream_text(client, body) -> str:
    text = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def repetitive_prompts(count: int) -> list[list[int]]:
    """Token-id prompts repeating a short phrase: n-gram drafts exist from the first step."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(4, 380) for _ in range(rng.randrange(2, 6))]
        out.append(phrase * rng.randrange(3, 8))
    return out


def test_outputs_equal_plain_serving_and_drafts_are_counted(spec_server, server):
    with server.client() as plain, spec_server.client() as spec:
        model = spec_server_model(spec)
        for i, prompt in enumerate(repetitive_prompts(12)):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0,
                    "ignore_eos": True}
            want = plain.post("/v1/completions", json=body).json()["choices"][0]["text"]
            got = spec.post("/v1/completions", json={**body, "model": model})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want
            if i < 3:
                assert _stream_text(spec, {**body, "model": model}) == want
    spec_server.wait_idle()
    drafts = spec_server.metric("memwall:spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("memwall:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert spec_server.metric("memwall:spec_decode_acceptance_rate") == pytest.approx(accepted / drafts)


def spec_server_model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("config, message", [
    ('{"method": "medusa"}', "speculative method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "model"),
    ('{"method": "ngram", "k": 4}', "k"),
    ("{not json", "JSON"),
])
def test_a_bad_config_is_refused_before_loading(model_dir, config, message):
    from memwall.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(model_dir), speculative_config=config)
