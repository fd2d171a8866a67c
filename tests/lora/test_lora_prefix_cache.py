"""The prefix cache never serves a block across adapters, nor after an adapter is reloaded with
new weights under the same name (its blocks are keyed by content, not name). The vLLM
behaviour (name keys), kept for comparison, serves the stale blocks: shown here too."""

from __future__ import annotations

import shutil

import pytest

from memwall import LLM, SamplingParams
from memwall.lora import LoRARequest
from tests.lora.conftest import make_peft_adapter, peft_greedy

PROMPT = list(range(3, 3 + 21))  # 5 full blocks of 4, then one token to compute
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _llm(base, **kw):
    return LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64,
               block_size=4, **kw)


def _run(llm, lora):
    out = llm.generate([PROMPT], GREEDY, lora_request=lora)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_blocks_are_never_shared_across_adapters(tiny_model_dir, peft_adapters):
    base, adapters = tiny_model_dir("llama"), peft_adapters("llama")
    a = LoRARequest("a", 1, str(adapters["all8"]))
    b = LoRARequest("b", 2, str(adapters["mlp16"]))
    llm = _llm(base)
    tokens_a, cached = _run(llm, a)
    assert cached == 0
    tokens_b, cached = _run(llm, b)
    assert cached == 0  # the same tokens through another adapter: other K/V
    assert tokens_b == peft_greedy(base, adapters["mlp16"], PROMPT, 6)
    tokens_base, cached = _run(llm, None)
    assert cached == 0 and tokens_base == peft_greedy(base, None, PROMPT, 6)
    again, cached = _run(llm, a)
    assert cached == 20 and again == tokens_a  # its own blocks do hit
    stats = llm.engine.stats.lora
    hit = {c.name: c.prefix_hit_rate for c in stats.adapters}
    assert hit["a"] > 0 and hit["b"] == 0


@pytest.mark.parametrize("policy", ["adapter-aware", "vllm"])
def test_reload_under_the_same_name_never_meets_stale_kv(policy, tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama")
    path = tmp_path / "adapter"
    make_peft_adapter(base, path, seed=11, r=8)
    llm = _llm(base, lora_cache_policy=policy)
    old_tokens, _ = _run(llm, LoRARequest("x", 1, str(path)))
    llm.engine.remove_lora(1)  # unloaded, then new weights at the same path, same name
    shutil.rmtree(path)
    make_peft_adapter(base, path, seed=12, r=8)
    new_tokens, cached = _run(llm, LoRARequest("x", 2, str(path)))
    expected = peft_greedy(base, path, PROMPT, 6)
    assert expected != old_tokens
    if policy == "adapter-aware":
        assert cached == 0 and new_tokens == expected
    else:  # vLLM #42125: keyed by name, the old adapter's KV is served to the new one
        assert cached == 20


def test_unloaded_adapters_leave_the_host_cache_and_their_kv_is_evicted_first(tiny_model_dir,
                                                                            peft_adapters):
    base, adapters = tiny_model_dir("llama"), peft_adapters("llama")
    llm = _llm(base)
    _run(llm, LoRARequest("a", 1, str(adapters["all8"])))
    llm.engine.remove_lora(1)
    _run(llm, None)  # a step runs: the idle adapter is dropped
    stats = llm.engine.stats.lora
    # 21 prompt + 5 computed output tokens: 6 full blocks, all of an adapter no longer loaded
    assert stats.resident == 0 and stats.cached_blocks == 6 and stats.not_resident_share == 1.0
    pool = llm.engine.core.kv.pool
    [owner] = [k for k in pool.cached_per_owner if k]
    assert pool.evict_value(owner) == -1.0 < pool.evict_value(())
