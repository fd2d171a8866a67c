"""Structured outputs through the engine: regex and choice can never be broken (temperature 1.0,
many samples), speculative decoding keeps greedy output identical, n > 1, compiles never stall
other requests, aborts and compile failures leak nothing."""

from __future__ import annotations

import re
import time

import pytest

from memwall import LLM, SamplingParams, StructuredOutputsParams
from memwall.engine.processor import InvalidRequestError
from memwall.structured.manager import StructuredOutputManager

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def constrained(temperature: float = 1.0, max_tokens: int = 64, seed: int | None = None, n: int = 1,
                **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n,
                          structured_outputs=StructuredOutputsParams(**constraint))


# ---- the embedded model: a mismatch is impossible ------------------------------------------
def test_regex_output_always_matches(smol_llm):
    pattern = r"[A-Z][a-z]{2,9} (is|was) [0-9]{1,3} years old\."
    prompt = [{"role": "user", "content": "Tell me about a person."}]
    out = smol_llm.chat(prompt, constrained(n=16, seed=3, regex=pattern))[0]
    assert len(out.outputs) == 16
    for sample in out.outputs:
        assert re.fullmatch(pattern, sample.text), sample.text
        assert sample.finish_reason == "stop"
    assert len({s.text for s in out.outputs}) > 1, "temperature 1.0 should vary the samples"


def test_choice_output_is_one_of_the_choices(smol_llm):
    choices = ["positive", "negative", "neutral", "mixed feelings"]
    prompt = [{"role": "user", "content": "Sentiment of: 'the food was fine, the service slow'"}]
    out = smol_llm.chat(prompt, constrained(n=16, seed=5, choice=choices))[0]
    for sample in out.outputs:
        assert sample.text in choices and sample.finish_reason == "stop"
    greedy = smol_llm.chat(prompt, constrained(temperature=0, choice=choices))[0].outputs[0]
    assert greedy.text in choices


def test_json_object_mode(smol_llm):
    import json
    prompt = [{"role": "user", "content": "Reply with a JSON object with the keys name and age "
                                          "for a cat named Tom who is 3."}]
    sample = smol_llm.chat(prompt, constrained(temperature=0, max_tokens=200, json_object=True))[0].outputs[0]
    assert isinstance(json.loads(sample.text), dict) and sample.finish_reason == "stop"


def test_bad_schema_is_refused_before_queueing(smol_llm):
    with pytest.raises(InvalidRequestError, match="Unimplemented keys") as info:
        smol_llm.generate("hi", constrained(json={"type": "object", "dependentSchemas": {"a": {}}}))
    assert info.value.param == "structured_outputs"
    assert not smol_llm.engine.has_unfinished_requests()


# ---- the tiny model: engine mechanics ------------------------------------------------------
REPEATS = r"(ab |cd |ef ){4,30}"
REPEATS_PREFIX = r"(ab |cd |ef )*(a|c|e)?(b|d|f)?"  # what max_tokens may cut it to


def follows_repeats(sample) -> bool:
    pattern = REPEATS if sample.finish_reason == "stop" else REPEATS_PREFIX
    return re.fullmatch(pattern, sample.text) is not None


def test_speculation_keeps_greedy_output_identical(tiny_llama):
    prompts = [[5 + i, 6, 7] * (3 + i) for i in range(8)]
    params = constrained(temperature=0, max_tokens=40, regex=REPEATS)

    def run(spec, **engine):
        llm = LLM(str(tiny_llama), speculative_config=spec, **{"num_kv_blocks": 256, "block_size": 4,
                                                               **engine})
        return llm, llm.generate(prompts, params)

    _, plain = run(None)
    for engine in ({}, dict(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=16)):
        llm, spec = run(NGRAM, **engine)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        for out in spec:
            assert follows_repeats(out.outputs[0]), out.outputs[0].text
        stats = llm.engine.core.scheduler.stats
        assert stats.spec_num_accepted_tokens > 10, "drafts were meant to be accepted"
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_preemption_keeps_grammars_in_step(tiny_llama):
    """Recompute and swap: a preempted request keeps its output and so its grammar's state."""
    prompts = [[5 + i, 6, 7] * (3 + i) for i in range(8)]
    params = constrained(temperature=0, max_tokens=40, regex=REPEATS)
    roomy = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4).generate(prompts, params)
    for mode in ("recompute", "swap"):
        llm = LLM(str(tiny_llama), num_kv_blocks=40, block_size=4, max_num_seqs=8,
                  max_num_batched_tokens=16, preemption_mode=mode)
        tight = llm.generate(prompts, params)
        assert llm.engine.core.scheduler.num_preemptions > 0, "the pool was meant to run dry"
        assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
        assert all(follows_repeats(o.outputs[0]) for o in tight)
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_sampled_speculation_still_matches(tiny_llama):
    llm = LLM(str(tiny_llama), speculative_config=NGRAM, num_kv_blocks=256, block_size=4)
    outs = llm.generate([[9, 10, 11] * 5] * 6, constrained(temperature=1.0, seed=7, max_tokens=48,
                                                           regex=REPEATS))
    for out in outs:
        assert follows_repeats(out.outputs[0]), out.outputs[0].text


def test_n_samples_each_follow_the_grammar(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4)
    out = llm.generate([[4, 5, 6, 7]], constrained(n=5, seed=1, regex=r"[a-f]{3}-[0-9]{2}"))[0]
    assert len(out.outputs) == 5
    for sample in out.outputs:
        assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", sample.text) and sample.finish_reason == "stop"
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def _slow_compiles(monkeypatch, seconds: float) -> None:
    original = StructuredOutputManager._compile

    def slow(self, name, params):
        time.sleep(seconds)
        return original(self, name, params)
    monkeypatch.setattr(StructuredOutputManager, "_compile", slow)


def test_a_compiling_grammar_never_stalls_other_requests(tiny_llama, monkeypatch):
    """The compile is held until the plain request has finished: the engine must get there."""
    import threading

    release = threading.Event()
    original = StructuredOutputManager._compile

    def held(self, name, params):
        assert release.wait(timeout=60), "the test never released the compile"
        return original(self, name, params)
    monkeypatch.setattr(StructuredOutputManager, "_compile", held)
    llm = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4)
    engine = llm.engine
    engine.add_request("constrained", [4, 5, 6], constrained(regex=r"[a-f]{3}", temperature=0))
    engine.add_request("plain", [4, 5, 6], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finished: list[str] = []
    try:
        while "plain" not in finished:
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished == ["plain"] and len(engine.core._preparing) == 1
    finally:
        release.set()
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["plain", "constrained"]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_abort_while_compiling_leaves_nothing(tiny_llama, monkeypatch):
    _slow_compiles(monkeypatch, 0.3)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    engine = llm.engine
    engine.add_request("a", [4, 5, 6], constrained(regex=r"[a-f]{9}", n=2))
    engine.step()
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.finished] == ["abort"]
    assert not engine.core._preparing and not engine.core.scheduler.requests
    # the engine still serves: the cached compile is reused
    again = llm.generate([[4, 5, 6]], constrained(regex=r"[a-f]{9}", seed=2))[0].outputs[0]
    assert re.fullmatch(r"[a-f]{9}", again.text)
    assert engine.core.structured.stats.num_cache_hits >= 1
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_grammar_that_fails_in_the_core_aborts_only_its_request(tiny_llama):
    from memwall.engine.protocol import EngineCoreRequest

    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    core = llm.engine.core
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(oops"))
    core.add_request(EngineCoreRequest("bad", [4, 5, 6], bad, 5))
    core.add_request(EngineCoreRequest("good", [4, 5, 6], SamplingParams(max_tokens=5), 5))
    reasons = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert reasons["good"][0] == "length"
    assert reasons["bad"][0] == "abort" and reasons["bad"][1]  # the compile error, as stop_reason
    assert core.kv.num_free_blocks == core.kv.num_total_blocks


def test_servers_warm_the_backend_up_and_offline_engines_wait_for_a_request():
    from memwall.entrypoints.cli import build_parser, engine_args_from

    parser = build_parser()
    assert engine_args_from(parser.parse_args(["serve"])).structured_outputs_warmup
    assert not engine_args_from(parser.parse_args(["serve", "--no-structured-outputs-warmup"])
                                ).structured_outputs_warmup
    assert not engine_args_from(parser.parse_args(["generate", "hi"])).structured_outputs_warmup


def test_the_backend_is_built_with_the_first_compile_unless_warmed(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    manager = llm.engine.core.structured
    assert not manager._backends  # nothing built at start-up: no memory spent on it
    llm.generate([[4, 5, 6]], constrained(regex="[a-c]{2}"))
    assert set(manager._backends) == {"llguidance"}
    warm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, structured_outputs_warmup=True)
    warm.engine.core.structured._thread.submit(lambda: None).result()  # after the warm-up task
    assert set(warm.engine.core.structured._backends) == {"llguidance"}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_complete_grammar_ends_the_request_despite_min_tokens(tiny_llama, backend):
    """min_tokens bans EOS, but a finished grammar allows nothing else: the grammar wins."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar backend is not installed")
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, structured_outputs_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "cd"]))
    out = llm.generate([[4, 5, 6]], params)[0].outputs[0]
    assert out.text in ("ab", "cd") and out.finish_reason == "stop"


def test_cli_structured_flags(tmp_path):
    """llama.cpp-style --json-schema / --grammar (text or @file), --regex, --choice, --json-object."""
    import argparse
    import json

    from memwall.entrypoints.cli import build_parser, sampling_params_from

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    parser = build_parser()

    def params(*flags) -> SamplingParams:
        return sampling_params_from(parser.parse_args(["generate", "hi", *flags]))

    assert params("--json-schema", f"@{tmp_path / 's.json'}").structured_outputs.json == schema
    assert params("--json-schema", json.dumps(schema)).structured_outputs.json == schema
    assert params("--choice", "yes", "--choice", "no").structured_outputs.choice == ["yes", "no"]
    assert params("--json-object").structured_outputs.kind == "json_object"
    assert params("--grammar", 'root ::= "x"').structured_outputs.grammar == 'root ::= "x"'
    assert params().structured_outputs is None
    with pytest.raises(ValueError, match="exactly one"):
        params("--regex", "a", "--choice", "b")
    with pytest.raises(ValueError, match="cannot read"):
        params("--json-schema", "@/no/such/file.json")
    assert isinstance(parser, argparse.ArgumentParser)


def test_regex_errors_name_the_problem():
    from memwall.structured import GrammarError, check

    with pytest.raises(GrammarError, match="unclosed group"):
        check(StructuredOutputsParams(regex="("))


def test_offline_chat_passes_tools_and_template_kwargs(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4)
    tok = llm.engine.tokenizer
    tok.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% if mood %}MOOD "
                         "{{ mood }}\n{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ids = llm.render_chat([{"role": "user", "content": "hi"}], tools=tools,
                          chat_template_kwargs={"mood": "calm"})
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith('TOOLS [{"type": "function"') and "MOOD calm" in text
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), tools=tools)
    assert len(out[0].outputs[0].token_ids) == 2
