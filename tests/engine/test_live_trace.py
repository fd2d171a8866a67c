"""The live dashboard's records, built by a real engine core on the tiny model: each step's
record says what ran (prompt chunks sum to the prompt, one decode step per further token,
speculation's counts), and the block map matches the KV manager's own tables."""

from __future__ import annotations

import pickle

import pytest

from memwall import LLM, SamplingParams
from memwall.core.live_view import CACHED, FREE, IN_USE, SHARED, build_view

GREEDY = dict(temperature=0, ignore_eos=True)
BUDGET = 24  # prompts longer than this are prefilled in chunks


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> None:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def test_step_records_match_what_ran(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4, max_model_len=128,
              max_num_batched_tokens=BUDGET, max_num_seqs=6, prefix_caching=False)
    prompts = [list(range(5, 5 + n)) for n in (3, 30, 11, 41)]
    run(llm, prompts, SamplingParams(max_tokens=7, **GREEDY))
    steps = llm.engine.core.live.steps()
    assert [s.index for s in steps] == list(range(len(steps)))  # every step, in order
    assert all(s.duration_s > 0 and s.num_tokens <= BUDGET for s in steps)
    per_request: dict[str, list] = {}
    for step in steps:
        for entry in step.entries():
            per_request.setdefault(entry.request_id, []).append(entry)
            assert (entry.prefill_tokens == 0) != (entry.decode_tokens == 0)
    assert sorted(per_request) == ["0", "1", "2", "3"]
    for rid, entries in per_request.items():
        prefill = [e.prefill_tokens for e in entries if e.prefill_tokens]
        assert sum(prefill) == len(prompts[int(rid)])
        assert len(prefill) >= -(-len(prompts[int(rid)]) // BUDGET)  # chunks within the budget
        decodes = [e for e in entries if e.decode_tokens]
        assert len(decodes) == 7 - 1 and all(e.decode_tokens == 1 for e in decodes)
        assert sum(e.new_tokens for e in entries) == 7  # the first comes from the prompt's end


def test_block_map_matches_the_kv_manager(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=48, block_size=4, max_model_len=128, max_num_seqs=6)
    engine, core = llm.engine, llm.engine.core
    assert core.live.view is None  # nobody watches: no block map is ever built
    engine.set_watched(True)  # a dashboard page opened: one at once, then at most 4 a second
    assert core.live.view is not None and set(core.live.view.states) == {FREE}
    shared = list(range(10, 26))  # 4 full blocks every request shares
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine.add_request("first", shared + [3], params)
    for _ in range(3):
        engine.step()  # "first" has computed and cached the shared blocks
    for i in range(3):
        engine.add_request(f"r{i}", shared + [40 + i, 41], params)
    for _ in range(3):
        engine.step()
    view = build_view(core.scheduler)
    kv = core.kv
    assert view.tables == {rid: tuple(t) for rid, t in kv.block_tables.items()}
    assert len(view.states) == kv.num_total_blocks
    held = [b for table in view.tables.values() for b in table]
    for block, state in enumerate(view.states):
        count = held.count(block)
        assert state == (SHARED if count > 1 else IN_USE if count else state), (block, state)
        assert (state in (FREE, CACHED)) == (count == 0)
    assert view.states.count(SHARED) >= 4  # the common prefix, held by all four
    assert {q.request_id for q in view.running} == set(view.tables)
    assert all(q.num_prompt_tokens >= 17 and q.status == "running" for q in view.running)
    pickle.loads(pickle.dumps(view))  # it crosses the core process's pipe
    while engine.has_unfinished_requests():
        engine.step()
    idle = core.live.view  # built at once as the engine went idle
    assert idle is not None and not idle.tables and not idle.running
    assert IN_USE not in idle.states and SHARED not in idle.states
    assert idle.states.count(CACHED) >= 4  # the finished prompts stay in the prefix cache
    engine.set_watched(False)
    run(llm, [shared], params)
    assert core.live.view is idle  # the page closed: no new map was built


def test_speculation_counts_per_step(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False}
    llm = LLM(tiny_llama, num_kv_blocks=128, block_size=4, speculative_config=spec)
    phrase = [7, 8, 9, 10, 11]
    run(llm, [phrase * 4, phrase * 3 + [12]], SamplingParams(max_tokens=24, **GREEDY))
    steps = llm.engine.core.live.steps()
    stats = llm.engine.core.scheduler.stats
    entries = [e for s in steps for e in s.entries()]
    assert sum(e.spec_proposed for e in entries) == stats.spec_num_draft_tokens > 0
    assert sum(e.spec_accepted for e in entries) == stats.spec_num_accepted_tokens
    for e in entries:
        if e.decode_tokens:  # the last token, its drafts; yields accepted + 1
            assert e.decode_tokens == 1 + e.spec_proposed
            assert e.new_tokens in (0, 1 + e.spec_accepted)
    assert sum(e.new_tokens for e in entries) == 48


def test_an_update_crosses_the_pipe_and_is_applied_once():
    from memwall.core.live_trace import LiveTrace, TraceUpdate
    from memwall.core.step_record import StepRecord

    steps = tuple(StepRecord(i, 100.0 + i, 0.01, ("a",), (0,), (1,), (1,), (0,), (0,))
                  for i in range(5))
    live = LiveTrace(capacity=4)
    live.apply(pickle.loads(pickle.dumps(TraceUpdate(steps[:3]))))
    live.apply(TraceUpdate(steps[2:]))  # step 2 again (a re-sent tail): kept once
    assert [s.index for s in live.steps()] == [1, 2, 3, 4]  # the ring keeps the last 4
    assert [s.index for s in live.since(2)] == [3, 4]
    assert live.since(4) == ()
