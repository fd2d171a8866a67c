"""The unified pool (adapter-aware policy): a loaded adapter's weights are parked in KV blocks of
the engine's pool and read back from them bit for bit; KV pressure drops an idle adapter (and
gives its blocks to sequences) before anyone is preempted; a dropped adapter asked for again is
reloaded and still gives its own tokens."""

from __future__ import annotations

import torch

from memwall import LLM, SamplingParams
from memwall.lora import LoRARequest
from memwall.lora.peft import load_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(base, policy, blocks=256, **kw):
    """Blocks of 16 tokens of the tiny model hold 4 KB: adapters here park in 1-18 blocks."""
    return LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=blocks,
               block_size=16, lora_cache_policy=policy, **kw)


def test_parked_weights_read_back_exactly_and_outputs_do_not_change(tiny_model_dir, peft_adapters):
    base, adapters = tiny_model_dir("llama"), peft_adapters("llama")
    loras = [LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(sorted(adapters.items()), 1)]
    prompts = [[4, 5, 6, 7, 8, 9]] * len(loras)
    unified = _llm(base, "adapter-aware")
    separate = _llm(base, "vllm")
    out_u = unified.generate(prompts, GREEDY, lora_request=loras)
    out_s = separate.generate(prompts, GREEDY, lora_request=loras)
    assert [o.outputs[0].token_ids for o in out_u] == [o.outputs[0].token_ids for o in out_s]
    core, worker = unified.engine.core, unified.engine.core.executor.worker
    parked = core.lora.blocks_of
    assert set(parked) == {lora.lora_int_id for lora in loras}
    held = sum(len(b) for b in parked.values())
    assert unified.engine.num_free_blocks == unified.engine.num_total_blocks - held
    assert not separate.engine.core.lora.blocks_of
    for lora in loras:  # read back from the KV blocks: the very bytes of the file
        back = worker.lora._unpark(worker.lora.host[lora.lora_int_id])
        disk = load_peft_adapter(lora.lora_path, lora.lora_name)
        assert back.modules.keys() == disk.modules.keys()
        for name, w in disk.modules.items():
            assert torch.equal(back.modules[name].a, w.a) and torch.equal(back.modules[name].b, w.b)


def test_kv_pressure_drops_idle_adapters_first_and_they_come_back(tiny_model_dir, peft_adapters):
    base, adapters = tiny_model_dir("llama"), peft_adapters("llama")
    a = LoRARequest("a", 1, str(adapters["all8"]))
    llm = _llm(base, "adapter-aware", blocks=40)  # the adapter parks in 16 of them
    first = llm.generate([[4, 5, 6]], GREEDY, lora_request=a)[0].outputs[0].token_ids
    core = llm.engine.core
    held = len(core.lora.blocks_of[1])
    assert held > 0
    # a base request needing more blocks than are free: the idle adapter gives its blocks back
    free = llm.engine.num_free_blocks
    long_prompt = [10 + i % 200 for i in range(16 * (free + 2))]
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.outputs[0].finish_reason == "length"
    assert 1 not in core.lora.blocks_of and 1 not in core.lora.loaded
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert core.scheduler.num_preemptions == 0 and core.lora.stats.evictions == 1
    again = llm.generate([[4, 5, 6]], GREEDY, lora_request=a)[0].outputs[0].token_ids
    assert again == first and core.lora.stats.loads == 2
