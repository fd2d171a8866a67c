"""The engine core with adapters: a load from disk never stalls other requests; a load that
fails finishes only its request; aborting while loading leaves nothing; more adapters than
slots and host-cache entries rotate and still give each request its own adapter's tokens;
n > 1 and ngram speculation work through adapters."""

from __future__ import annotations

import threading

import pytest

from memwall import LLM, SamplingParams
from memwall.lora import LoRARequest
from memwall.lora.worker_lora import WorkerLoRA
from tests.lora.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(base, **kw):
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=128, block_size=4)
    args.update(kw)
    return LLM(str(base), **args)


def test_an_adapter_loading_never_stalls_other_requests(tiny_model_dir, peft_adapters, monkeypatch):
    release = threading.Event()
    original = WorkerLoRA.add

    def held(self, lora):
        assert release.wait(timeout=60), "the test never released the load"
        return original(self, lora)
    monkeypatch.setattr(WorkerLoRA, "add", held)
    llm = _llm(tiny_model_dir("llama"))
    engine = llm.engine
    engine.add_request("adapter", [4, 5, 6], GREEDY, LoRARequest("a", 1, str(peft_adapters()["all8"])))
    engine.add_request("plain", [4, 5, 6], GREEDY)
    finished: list[str] = []
    try:
        while "plain" not in finished:
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished == ["plain"] and len(engine.core._preparing) == 1
    finally:
        release.set()
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["plain", "adapter"]
    parked = sum(len(b) for b in engine.core.lora.blocks_of.values())  # adapters' weights
    assert engine.num_free_blocks + parked == engine.num_total_blocks


def test_a_failed_load_finishes_only_its_request(tiny_model_dir, tmp_path):
    llm = _llm(tiny_model_dir("llama"))
    outs = llm.generate([[4, 5, 6], [4, 5, 6]], GREEDY,
                        lora_request=[LoRARequest("gone", 1, str(tmp_path / "missing")), None])
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "does not exist" in str(outs[0].outputs[0].stop_reason)
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 8
    core = llm.engine.core
    assert not core._preparing and not core.scheduler.requests and core.lora.loaded == {}


def test_abort_while_loading_leaves_nothing(tiny_model_dir, peft_adapters, monkeypatch):
    release = threading.Event()
    original = WorkerLoRA.add
    monkeypatch.setattr(WorkerLoRA, "add", lambda self, lora: (release.wait(60), original(self, lora))[1])
    llm = _llm(tiny_model_dir("llama"))
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=8, n=2, seed=1)
    engine.add_request("x", [4, 5, 6], params, LoRARequest("a", 1, str(peft_adapters()["all8"])))
    engine.step()
    engine.abort_request("x")
    release.set()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["abort"]
    assert not engine.core._preparing and not engine.core.scheduler.requests
    parked = sum(len(b) for b in engine.core.lora.blocks_of.values())  # adapters' weights
    assert engine.num_free_blocks + parked == engine.num_total_blocks


def test_more_adapters_than_slots_and_host_cache_rotate(tiny_model_dir, tmp_path):
    """6 adapters, 2 slots, a host cache of 3: every request still gets its own adapter's
    tokens (compared with each adapter alone on a fresh engine)."""
    base = tiny_model_dir("llama")
    folders = [make_peft_adapter(base, tmp_path / f"a{i}", seed=20 + i, r=4) for i in range(6)]
    loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    prompts = [[4, 5, 6 + i] for i in range(12)]
    per_prompt = [loras[i % 6] for i in range(12)]
    llm = _llm(base, max_cpu_loras=3)
    together = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    stats = llm.engine.stats.lora
    assert stats.evictions >= 3 and stats.resident <= 3
    alone_llm = _llm(base, max_loras=1, max_cpu_loras=1)
    for prompt, lora, out in zip(prompts, per_prompt, together):
        alone = alone_llm.generate([prompt], GREEDY, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, lora.lora_name


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}])
def test_n_samples_and_ngram_speculation_through_an_adapter(tiny_model_dir, peft_adapters, spec):
    base, path = tiny_model_dir("llama"), peft_adapters()["qv4"]
    lora = LoRARequest("qv", 1, str(path))
    prompt = [4, 5, 6, 4, 5, 6, 4, 5]  # repeats: ngram drafts get accepted
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _llm(base).generate([prompt], greedy, lora_request=lora)[0].outputs[0].token_ids
    llm = _llm(base, speculative_config=spec)
    assert llm.generate([prompt], greedy, lora_request=lora)[0].outputs[0].token_ids == plain
    samples = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, n=3,
                                                    ignore_eos=True), lora_request=lora)[0]
    assert [s.token_ids for s in samples.outputs] == [plain] * 3


def test_lora_with_a_drafting_model_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="ngram drafts work"):
        _llm(tiny_model_dir("llama"), speculative_config={"method": "draft_model",
                                                          "model": str(tiny_model_dir("llama"))})
