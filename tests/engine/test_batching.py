"""Continuous batching end to end on a tiny model: invariance, preemption, leaks, parity."""

from __future__ import annotations

import random

import pytest
import torch

from memwall import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def varied_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 380) for _ in range(rng.randrange(3, 90))] for _ in range(count)]


def test_greedy_matches_hf_generate(tiny_llama):
    import transformers

    prompt = [5, 17, 99, 230, 42, 8, 150]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref


def test_batch_invariance_with_chunked_prefill_and_preemption(tiny_llama):
    """24 prompts: alone vs all together under a KV budget that forces preemption."""
    prompts = varied_prompts(24)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone_llm = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4)
    alone = [alone_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # 40 blocks x 4 tokens = 160 tokens of KV for ~24 x 65 tokens of work; 32-token step budget.
    tight = LLM(str(tiny_llama), num_kv_blocks=40, block_size=4, max_num_batched_tokens=32,
                max_num_seqs=16, max_model_len=128)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    engine = tight.engine
    assert engine.core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert together == alone
    assert engine.num_free_blocks == engine.num_total_blocks


def test_no_block_leak_after_aborts_mid_flight(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(varied_prompts(8, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    aborted_outputs = {}
    for step in range(200):
        if step == 2:
            engine.abort_request("r0")  # running
            engine.abort_request("r7")  # probably still waiting
        if step == 5:
            engine.abort_request("r3")
        for output in engine.step():
            if output.finished:
                aborted_outputs[output.request_id] = output.outputs[0].finish_reason
        if not engine.has_unfinished_requests():
            break
    assert aborted_outputs["r0"] == "abort" and aborted_outputs["r3"] == "abort"
    assert aborted_outputs["r7"] == "abort"
    assert sum(reason == "length" for reason in aborted_outputs.values()) == 5
    assert engine.num_free_blocks == engine.num_total_blocks


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=128, block_size=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompts = varied_prompts(5, seed=3)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    batch = llm.generate(prompts, [seeded] + [other] * 4)
    assert batch[0].outputs[0].token_ids == alone
    different = llm.generate([prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=43,
                                                          max_tokens=16, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone
