"""The embedded SmolLM2 Q4_1 GGUF: our loader + model against transformers loading the same file.

transformers dequantizes the GGUF to float32 with gguf's numpy reference; we dequantize with our
own torch kernels. Logits must agree at atol 1e-3 (30 layers of float32 accumulate more rounding
than the tiny models), and greedy tokens must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from memwall.attention.metadata import AttentionMetadata
from memwall.loader.model_loader import load_model
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache

GGUF_ATOL = 1e-3
GGUF_RTOL = 1e-3
pytestmark = pytest.mark.usefixtures("exact_kernels")  # parity with transformers: exact kernels


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(str(gguf_path))


@torch.no_grad()
def test_embedded_gguf_logits_match_transformers(ours, hf_gguf_model):
    ids = ours.tokenizer.encode("The memory wall: decode reads every weight once per token, so")
    reference = hf_gguf_model(torch.tensor([ids])).logits[0]
    plan = KVCachePlan(num_blocks=16, block_size=16, bytes_per_block=0)
    caches = allocate_kv_cache(ours.arch, plan, torch.float32)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(16))], 16)
    logits = ours.model.compute_logits(ours.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta))
    torch.testing.assert_close(logits, reference, atol=GGUF_ATOL, rtol=GGUF_RTOL)


@torch.no_grad()
def test_embedded_gguf_greedy_tokens_match_transformers(gguf_path, hf_gguf_model):
    from memwall import LLM, SamplingParams

    llm = LLM(str(gguf_path), num_kv_blocks=64)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    prompt = llm.render_chat(messages)
    ref = hf_gguf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref
