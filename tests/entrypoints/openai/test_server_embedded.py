"""The server over the embedded SmolLM2-135M (the default model): a real chat answer, streamed and not."""

from __future__ import annotations

import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_embedded_model_answers_through_the_sdk(gguf_path, start_server):
    live = start_server(None, num_kv_blocks=64, max_model_len=2048, max_num_seqs=8, threads=None)
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=20)
        streamed = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                  max_tokens=20, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert "Paris" in out.choices[0].message.content
        assert text == out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"  # the model ends its turn by itself
        live.wait_idle()
    finally:
        live.stop()
