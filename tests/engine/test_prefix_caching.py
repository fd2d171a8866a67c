"""Prefix caching, forks, swap/recompute preemption and priorities through the whole engine."""

from __future__ import annotations

import random

import pytest

from memwall import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def shared_prefix_prompts(seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(4, 380) for _ in range(45)]
    shared = [system + [rng.randrange(4, 380) for _ in range(rng.randrange(1, 20))] for _ in range(10)]
    unshared = [[rng.randrange(4, 380) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    return shared + unshared


def run(llm, prompts, params=GREEDY):
    return [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params)]


def test_outputs_identical_with_caching_on_and_off(model_path):
    prompts = shared_prefix_prompts()
    off = LLM(model_path, num_kv_blocks=256, block_size=4, prefix_caching=False)
    on = LLM(model_path, num_kv_blocks=256, block_size=4, max_num_seqs=4)
    expected = run(off, prompts)
    assert run(on, prompts) == expected  # first pass: hits between requests of one batch
    stats = on.engine.core.kv.stats
    assert stats.hits > 0
    first_hits = stats.hits
    assert run(on, prompts) == expected  # second pass: nearly all prompt blocks come from the cache
    assert stats.hits - first_hits >= sum(len(p) - 4 for p in prompts) * 0.5
    assert off.engine.core.kv.stats.hits == 0
    assert on.engine.num_free_blocks == on.engine.num_total_blocks


def test_forked_samples_match_separate_requests(model_path):
    """n=3 forks the prompt's KV (copy on write for the shared partial block) and samples
    each child with its own seed: identical to three n=1 requests with seeds s, s+1, s+2."""
    prompt = [random.Random(5).randrange(4, 380) for _ in range(18)]  # 18 % 4 != 0: partial block
    llm = LLM(model_path, num_kv_blocks=128, block_size=4, prefix_caching=False)
    sampled = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    forked = llm.generate([prompt], sampled)[0]
    separate = [llm.generate([prompt], SamplingParams(temperature=0.9, seed=11 + i, max_tokens=10,
                                                      ignore_eos=True))[0].outputs[0].token_ids
                for i in range(3)]
    assert [o.token_ids for o in forked.outputs] == separate
    greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_match_ample_memory(model_path, mode):
    prompts = shared_prefix_prompts(seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ample = run(LLM(model_path, num_kv_blocks=512, block_size=4), prompts, params)
    tight = LLM(model_path, num_kv_blocks=48, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=96, preemption_mode=mode, swap_space=1 << 22)
    assert run(tight, prompts, params) == ample
    stats = tight.engine.core.scheduler.stats
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
    else:
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    kv = tight.engine.core.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.swap_pool is None or kv.swap_pool.num_free_blocks == kv.swap_pool.num_blocks


def test_priority_policy_runs_important_requests_first(model_path):
    llm = LLM(model_path, num_kv_blocks=128, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    order = []
    for rid, prio in [("low", 5), ("high", -1), ("mid", 0)]:
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True, priority=prio))
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]
