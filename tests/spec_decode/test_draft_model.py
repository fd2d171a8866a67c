"""Draft-model speculation on tiny models: the drafter's cache follows the sequence exactly
(a long-lived proposer drafts what a fresh one would), greedy output equals plain decoding in
mixed batches under preemption, the distribution holds at temperature 0.8, nothing leaks, and a
drafter with another tokenizer is refused with a clear error."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from memwall import LLM, SamplingParams
from memwall.attention.backend import choose as choose_backend, get_backend
from memwall.loader.model_loader import load_model
from memwall.spec_decode.draft_model import DraftModelError, DraftModelProposer
from memwall.spec_decode.proposer import DraftRequest
from memwall.worker.cpu_decode import FusedCpuDecode
from memwall.worker.kv_cache import KVCachePlan, allocate_kv_cache


def spec(draft, k=4):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "adaptive": False}


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 380) for _ in range(rng.randrange(1, 70))] for _ in range(count)]


@pytest.fixture(scope="module")
def loaded_draft(noisy_draft):
    return load_model(str(noisy_draft))


def make_proposer(loaded, num_blocks=64, block_size=4, fused=False) -> DraftModelProposer:
    """A drafter with a fresh cache of its own over the (shared, read-only) loaded model;
    ``fused``: with the fused CPU decode step over that cache, as the worker builds it."""
    plan = KVCachePlan(num_blocks, block_size, 0)
    caches = allocate_kv_cache(loaded.arch, plan, torch.float32)
    fast_path = FusedCpuDecode.build(loaded.model, caches) if fused else None
    return DraftModelProposer(loaded.model, loaded.arch, caches, block_size,
                              get_backend(choose_backend("cpu")), fast_path=fast_path)


def cached_kv(proposer: DraftModelProposer, request_id: str) -> tuple[list[int], torch.Tensor]:
    """(tokens, keys of every layer at their positions) the drafter holds for a sequence."""
    tokens, blocks = proposer.tokens[request_id], proposer.cache.blocks[request_id]
    bs = proposer.cache.block_size
    slots = [blocks[p // bs] * bs + p % bs for p in range(len(tokens))]
    keys = torch.stack([k.flatten(0, 1)[slots].float() for k, _ in proposer.cache.kv_caches])
    return list(tokens), keys


def test_a_long_lived_drafter_drafts_what_a_fresh_one_would(loaded_draft):
    """Sequences grow by accepted drafts (some, all or none) plus one token, and sometimes
    restart elsewhere: the kept cache is rolled back and extended, never stale (its keys are
    those a fresh drafter computes for the same tokens)."""
    lived = make_proposer(loaded_draft, num_blocks=512)
    rng = random.Random(0)
    seqs = {f"s{i}": p for i, p in enumerate(prompts(3, seed=1))}
    for _ in range(25):
        reqs = [DraftRequest(rid, np.array(tokens, dtype=np.int64), rng.randrange(1, 6))
                for rid, tokens in seqs.items()]
        drafts = lived.propose(reqs)
        for req in reqs:
            new = make_proposer(loaded_draft, num_blocks=512)
            fresh = new.propose([req])[req.request_id]
            assert drafts[req.request_id] == fresh
            assert len(fresh) == req.max_drafts
            tokens, keys = cached_kv(lived, req.request_id)
            assert tokens == req.token_ids.tolist() + fresh[:-1]
            fresh_tokens, fresh_keys = cached_kv(new, req.request_id)
            assert fresh_tokens == tokens
            torch.testing.assert_close(keys, fresh_keys, rtol=0, atol=2e-2)
        for rid in seqs:
            keep = drafts[rid][:rng.randrange(0, len(drafts[rid]) + 1)]
            seqs[rid] = seqs[rid] + keep + [rng.randrange(4, 380)]
        if rng.random() < 0.2:  # a sequence rewritten from an earlier point (preempted, resumed)
            rid = rng.choice(list(seqs))
            cut = rng.randrange(1, len(seqs[rid]))
            seqs[rid] = seqs[rid][:cut] + [rng.randrange(4, 380) for _ in range(rng.randrange(1, 12))]
    lived.forget(list(seqs))
    assert lived.num_free_blocks == 512


def test_a_few_new_tokens_a_sequence_take_the_fused_decode_step(loaded_draft):
    """After a verify that accepted every draft the drafter feeds two tokens (its last draft,
    then the sampled one): as one-token rows of the sequence they go through the fused decode
    step, as the target's verification does, not the model's per-layer forward; the drafts are
    a fresh drafter's, and the cache holds the keys that drafter computes."""
    lived = make_proposer(loaded_draft, num_blocks=128, fused=True)
    if lived.fast_path is None:
        pytest.skip("no fused CPU decode step here (no C compiler)")
    calls = {"model": 0, "fused": 0}
    model, run = lived.model, lived.fast_path.run_rows

    def counting_model(*args, **kwargs):
        calls["model"] += 1
        return model(*args, **kwargs)

    def counting_run(*args, **kwargs):
        calls["fused"] += 1
        return run(*args, **kwargs)

    lived.model, lived.fast_path.run_rows = counting_model, counting_run
    tokens = [random.Random(11).randrange(4, 380) for _ in range(40)]  # a 40-token prompt
    drafts = lived.propose([DraftRequest("a", np.array(tokens), 4)])["a"]
    assert calls == {"model": 1, "fused": 3}  # the prompt, then one token a forward
    for extra in ([], [9, 10, 11]):  # every draft accepted, then rows past one block
        tokens = tokens + drafts + extra + [7]
        calls.update(model=0, fused=0)
        drafts = lived.propose([DraftRequest("a", np.array(tokens), 4)])["a"]
        assert calls == {"model": 0, "fused": 4}
        fresh = make_proposer(loaded_draft, num_blocks=128)
        assert drafts == fresh.propose([DraftRequest("a", np.array(tokens), 4)])["a"]
        lived_tokens, lived_keys = cached_kv(lived, "a")
        fresh_tokens, fresh_keys = cached_kv(fresh, "a")
        assert lived_tokens == fresh_tokens == tokens + drafts[:-1]
        torch.testing.assert_close(lived_keys, fresh_keys, rtol=0, atol=1e-4)
    lived.forget(["a"])
    assert lived.num_free_blocks == 128


def test_a_full_pool_skips_drafting_and_frees_its_blocks(loaded_draft):
    lived = make_proposer(loaded_draft, num_blocks=6, block_size=4)  # 24 tokens of KV
    short, long = np.arange(4, 14), np.arange(4, 40)
    drafts = lived.propose([DraftRequest("a", short, 4), DraftRequest("b", long, 4)])
    assert len(drafts["a"]) == 4 and "b" not in drafts  # b needs 10 blocks
    lived.forget(["a"])
    assert lived.num_free_blocks == 6


def test_greedy_equals_plain_decoding_in_mixed_batches_under_preemption(target, noisy_draft):
    ps = prompts(16, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(target), num_kv_blocks=256, block_size=4).generate(ps, params)
    for mode in ("recompute", "swap"):
        llm = LLM(str(target), speculative_config=spec(noisy_draft), num_kv_blocks=48, block_size=4,
                  max_num_batched_tokens=20, max_num_seqs=8, max_model_len=160, preemption_mode=mode)
        out = llm.generate(ps, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0
        stats = core.scheduler.stats
        assert stats.spec_num_verify_steps > 20
        # a noisy copy: most drafts accepted, not all (both paths of the verifier ran)
        assert 0.3 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.99
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_the_target_as_its_own_drafter_is_always_accepted(target):
    """Same weights, same arithmetic row for row: every greedy draft is the target's token."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(target), speculative_config=spec(target, k=3), num_kv_blocks=256, block_size=4)
    out = llm.generate(prompts(6, seed=3), params)
    stats = llm.engine.core.scheduler.stats
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.97
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    metrics = out[0].metrics
    assert metrics.num_verify_steps and metrics.spec_mean_accepted_length > 3.5


def test_temperature_sampling_keeps_the_distribution(target, noisy_draft):
    prompt = list(range(4, 60))
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)  # the 2nd is verified
    counts = []
    for config in (None, spec(noisy_draft, k=1)):
        llm = LLM(str(target), speculative_config=config, num_kv_blocks=4096, block_size=4,
                  max_num_seqs=64, seed=11 if config else 12)
        counts.append([o.outputs[0].token_ids[1] for o in llm.generate([prompt] * 2000, params)])
        if config:
            assert llm.engine.core.scheduler.stats.spec_num_verify_steps > 1000
    tokens = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.count(t) for t in tokens] for c in counts]
    keep = [i for i in range(len(tokens)) if table[0][i] + table[1][i] >= 10]
    assert len(keep) >= 3
    assert chi2_contingency([[row[i] for i in keep] for row in table]).pvalue > 1e-3


def test_another_tokenizer_is_refused_with_a_clear_error(target, gguf_path):
    with pytest.raises(DraftModelError, match="needs the target's tokenizer"):
        LLM(str(target), speculative_config=spec(gguf_path))


def test_a_requantized_drafter_keeps_greedy_output_and_drafts_from_4_bit_weights(gguf_path):
    """``"requantize": "q4_1"``: the drafter's byte-a-code weights (the embedded model's tied
    Q8_0 embedding, which its LM head reads) become Q4_1; its drafts change, the output does not."""
    ps = [[1, 9, 40, 300, 77] * k for k in (1, 3, 8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(gguf_path), num_kv_blocks=128).generate(ps, params)
    config = {**spec(gguf_path), "requantize": "q4_1"}
    llm = LLM(str(gguf_path), speculative_config=config, num_kv_blocks=128)
    out = llm.generate(ps, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    worker = llm.engine.core.executor.worker
    assert worker.draft.model.lm_head.source == "gguf Q4_1"
    assert worker.loaded.model.lm_head.source == "gguf Q8_0"  # the target's own stays
    stats = llm.engine.core.scheduler.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "requantize": "q4_1"}, "requantize applies to the draft_model and eagle"),
    ({"method": "draft_model", "model": "x.gguf", "requantize": "int4"}, "q4_0 or q4_1"),
    ({"method": "eagle", "model": "head", "requantize": "q4_0"}, "q4_1 for the eagle method"),
])
def test_requantize_is_checked_in_the_config(config, message):
    from memwall.config import SpeculativeConfig

    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)
