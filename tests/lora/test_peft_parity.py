"""Each adapter's greedy output equals HF + PEFT with the same adapter; a mixed batch of adapters
and the base gives each request what it gets alone."""

from __future__ import annotations

import pytest

from memwall import LLM, SamplingParams
from memwall.lora import LoRARequest
from tests.lora.conftest import peft_greedy

PROMPTS = [[0, 5, 9, 14, 3, 7], [0, 22, 8, 31, 2, 19, 44, 6, 11], [0, 3, 3, 17, 40]]
MAX_TOKENS = 12


def _llm(base, **kw):
    args = dict(enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=64, block_size=4,
                max_num_seqs=16)
    args.update(kw)
    return LLM(str(base), **args)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_each_adapter_equals_hf_peft(kind, tiny_model_dir, peft_adapters):
    base, adapters = tiny_model_dir(kind), peft_adapters(kind)
    llm = _llm(base)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (name, path) in enumerate(sorted(adapters.items()), start=1):
        lora = LoRARequest(name, i, str(path))
        outs = llm.generate(PROMPTS, greedy, lora_request=lora)
        for prompt, out in zip(PROMPTS, outs):
            expected = peft_greedy(base, path, prompt, MAX_TOKENS)
            assert out.outputs[0].token_ids == expected, (name, prompt)
    base_out = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    assert base_out == peft_greedy(base, None, PROMPTS[0], MAX_TOKENS)
    # the adapters change the output (else the parity above proves nothing)
    assert any(peft_greedy(base, p, PROMPTS[0], MAX_TOKENS) != base_out for p in adapters.values())


def test_mixed_batch_equals_each_alone(tiny_model_dir, peft_adapters):
    base, adapters = tiny_model_dir("llama"), peft_adapters("llama")
    loras = [LoRARequest(name, i, str(p)) for i, (name, p) in enumerate(sorted(adapters.items()), 1)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    batch_loras = [None] + loras  # base + 4 adapters, each on every prompt
    prompts = [p for p in PROMPTS for _ in batch_loras]
    per_prompt = batch_loras * len(PROMPTS)
    llm = _llm(base)
    together = llm.generate(prompts, greedy, lora_request=per_prompt)
    single = _llm(base, prefix_caching=False)  # one request at a time, nothing cached
    for prompt, lora, out in zip(prompts, per_prompt, together):
        alone = single.generate([prompt], greedy, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, (prompt, lora)


def test_prompt_longer_than_the_step_budget_through_an_adapter(tiny_model_dir, peft_adapters):
    """Chunked prefill across blocks and steps (budget 16 tokens, blocks of 4, a 43-token
    prompt) with the native kernels on, then fused decodes: still HF + PEFT's tokens."""
    base, path = tiny_model_dir("llama"), peft_adapters("llama")["all8"]
    prompt = [0] + [3 + (7 * i) % 200 for i in range(42)]
    llm = _llm(base, max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], greedy, lora_request=LoRARequest("all8", 1, str(path)))[0]
    assert out.outputs[0].token_ids == peft_greedy(base, path, prompt, MAX_TOKENS)
