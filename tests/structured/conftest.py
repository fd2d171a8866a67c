"""One engine over the embedded SmolLM2-135M GGUF for the structured-output tests: a real
model writes real JSON, so these tests see the lengths and loops a user would."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def smol_llm(gguf_path):
    from memwall import LLM

    return LLM(str(gguf_path), num_kv_blocks=1024, max_model_len=1024, max_num_seqs=64,
               max_num_batched_tokens=1024, threads=2)
