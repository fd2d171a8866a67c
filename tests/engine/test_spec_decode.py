"""Speculative decoding end to end on a tiny model: greedy output identical with and without
it (batched, crossing block boundaries, under preemption, with every request option), the
same distribution at temperature 0.8, no leaked blocks, and its counters."""

from __future__ import annotations

import random

import pytest
from scipy.stats import chi2_contingency

from memwall import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (so drafts exist), 3 to ~90 tokens, crossing 4-token blocks."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(4, 380) for _ in range(rng.randrange(2, 9))]
        prompts.append((phrase * rng.randrange(1, 10))[:rng.randrange(3, 90)])
    return prompts


def run(model, prompts, params, spec=None, **engine):
    llm = LLM(str(model), speculative_config=spec, **{"num_kv_blocks": 256, "block_size": 4,
                                                      **engine})
    outs = llm.generate(prompts, params)
    return llm, outs


def test_greedy_is_identical_with_and_without_speculation(tiny_llama):
    prompts = repetitive_prompts(24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, plain = run(tiny_llama, prompts, params)
    llm, spec = run(tiny_llama, prompts, params, NGRAM)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.core.scheduler.stats
    assert stats.spec_num_verify_steps > 50 and stats.spec_num_accepted_tokens > 10
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some were rejected
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks


def test_greedy_identical_under_preemption_tight_budget_and_prefix_caching(tiny_llama):
    prompts = repetitive_prompts(16, seed=1)
    prompts += [prompts[0] + [5, 6], prompts[1][:10]]  # shared prefixes
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, plain = run(tiny_llama, prompts, params)
    for mode in ("recompute", "swap"):
        llm, spec = run(tiny_llama, prompts, params, NGRAM, num_kv_blocks=48,
                        max_num_batched_tokens=20, max_num_seqs=8, max_model_len=160,
                        preemption_mode=mode)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
        assert core.scheduler.stats.spec_num_verify_steps > 20
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_request_options_hold_with_speculation(tiny_llama):
    """n > 1, stop strings, stop tokens, min_tokens, max_tokens, logprobs, penalties."""
    prompts = repetitive_prompts(6, seed=2)
    cases = [
        SamplingParams(temperature=0, max_tokens=25, n=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, min_tokens=10),
    ]
    # one engine of each kind for every case (later cases meet earlier ones' cached prefixes)
    plain_llm = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4)
    llm = LLM(str(tiny_llama), speculative_config=NGRAM, num_kv_blocks=256, block_size=4)
    for params in cases:
        plain, spec = plain_llm.generate(prompts, params), llm.generate(prompts, params)
        for a, b in zip(plain, spec):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], params
            assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
            if params.logprobs:
                for ca, cb in zip(a.outputs, b.outputs):
                    for la, lb in zip(ca.logprobs, cb.logprobs):
                        assert la.keys() == lb.keys()
                        for t in la:
                            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                            assert la[t].rank == lb[t].rank
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    # stop tokens and stop strings: taken from the plain output, so they really occur
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = plain_llm.generate(prompts, params)
    stop_token = plain[0].outputs[0].token_ids[12]
    text = plain[1].outputs[0].text
    stop_text = text[len(text) // 2:len(text) // 2 + 3]
    for params in (SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
                   SamplingParams(temperature=0, max_tokens=40, stop=[stop_text])):
        plain, spec = plain_llm.generate(prompts, params), llm.generate(prompts, params)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in spec] == \
            [(o.outputs[0].text, o.outputs[0].finish_reason) for o in plain]


def test_temperature_sampling_keeps_the_distribution(tiny_llama):
    """3000 samples of three tokens at temperature 0.8: the second token (verified against
    n-gram drafts when spec is on) is distributed the same with and without speculation."""
    prompt = list(range(4, 380))  # whatever the first token is, a 1-gram draft follows it
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
    counts = []
    for spec in (None, NGRAM):
        llm = LLM(str(tiny_llama), speculative_config=spec, num_kv_blocks=4096, block_size=4,
                  max_num_seqs=64, seed=5 if spec else 6)
        outs = llm.generate([prompt] * 3000, params)
        pairs = [tuple(o.outputs[0].token_ids) for o in outs]
        counts.append(pairs)
        if spec:
            stats = llm.engine.core.scheduler.stats
            assert stats.spec_num_verify_steps > 1000  # the second tokens went through verification
    tokens = sorted({p[1] for pairs in counts for p in pairs})
    table = [[sum(1 for p in pairs if p[1] == t) for t in tokens] for pairs in counts]
    keep = [i for i in range(len(tokens)) if table[0][i] + table[1][i] >= 10]
    table = [[row[i] for i in keep] for row in table]
    assert len(keep) >= 3
    assert chi2_contingency(table).pvalue > 1e-3, table


def test_seeded_requests_are_reproducible_with_speculation(tiny_llama):
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0.9, max_tokens=30, seed=42, ignore_eos=True)
    _, first = run(tiny_llama, prompts, params, NGRAM)
    _, again = run(tiny_llama, prompts[::-1], params, NGRAM)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again[::-1]]


def test_a_seeded_request_samples_the_same_tokens_with_speculation_on_or_off(tiny_llama):
    """Each output position of a seeded request draws from a generator of its own
    (sample/seeds.py) and verification keeps a draft only where it is that draw, so the tokens
    do not depend on how many drafts a step verified (the adaptive lengths follow this
    machine's step timings: one generator a request, drawn in turn, gave the embedded model
    other tokens on every run), on preemption, or on speculation at all."""
    prompts = repetitive_prompts(12, seed=5)
    params = [SamplingParams(temperature=0.1, top_p=0.95, max_tokens=30, seed=100 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    _, plain = run(tiny_llama, prompts, params)
    expected = [o.outputs[0].token_ids for o in plain]
    for spec, engine in (({**NGRAM, "num_speculative_tokens": 2}, {}),
                         (NGRAM, {}),
                         (NGRAM, {"num_kv_blocks": 48, "max_num_batched_tokens": 20,
                                  "max_num_seqs": 8, "max_model_len": 160})):
        llm, out = run(tiny_llama, prompts, params, spec, **engine)
        assert [o.outputs[0].token_ids for o in out] == expected
        stats = llm.engine.core.scheduler.stats
        assert stats.spec_num_accepted_tokens >= 8  # drafts were kept, not only rejected
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        if "num_kv_blocks" in engine:
            assert llm.engine.core.scheduler.num_preemptions > 0
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_aborts_mid_verification_leak_no_block(tiny_llama):
    llm = LLM(str(tiny_llama), speculative_config=NGRAM, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts(8, seed=4)):
        engine.add_request(f"r{i}", prompt, params)
    for step in range(300):
        if step in (3, 6, 9):
            engine.abort_request(f"r{step // 3}")
        engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks


def test_adaptive_drafting_learns_the_cost_of_the_steps_it_runs(tiny_llama):
    """Every decode/verify step's wall time reaches the draft-length policy's cost table, by
    its rows; the prompt's step does not."""
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "adaptive": True},
              num_kv_blocks=256, block_size=4)
    core = llm.engine.core
    execute, rows = core.executor.execute, []

    def counted(sched):
        if not sched.is_empty:
            rows.append(sum(sched.num_scheduled_tokens.values()))
        return execute(sched)

    core.executor.execute = counted
    prompt = [7, 81, 9, 120, 11] * 12  # a repeated phrase: drafts exist
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    learned = core.executor.worker.runner.draft_lengths.cost
    assert rows[0] == 60  # the prompt, in one step
    steps = rows[1:]
    assert len(steps) >= 8 and 1 < max(steps) <= 5  # decodes and verifies
    assert {n: learned.samples(n) for n in set(rows)} == {n: steps.count(n) for n in set(rows)}
    seen = max(set(steps), key=steps.count)
    assert 0 < learned(seen) < 1.0  # seconds, learned from real steps


def test_no_drafts_while_a_prompt_is_read_in_chunks(tiny_llama):
    """While a long prompt is read 24 tokens a step, the short sequence decoding beside it
    drafts nothing (a step carrying a prompt chunk goes the prefill way, and drafts there cost
    more than they brought); once the prompt is read, it drafts again."""
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "adaptive": False},
              num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    core = llm.engine.core
    execute, steps = core.executor.execute, []

    def recorded(sched):
        if not sched.is_empty:
            chunk = any(n > 1 + len(sched.spec_token_ids.get(r) or ())
                        for r, n in sched.num_scheduled_tokens.items())
            steps.append((chunk, sum(len(d or ()) for d in sched.spec_token_ids.values())))
        return execute(sched)

    core.executor.execute = recorded
    short = [7, 81, 9, 120, 11] * 2  # a repeated phrase: drafts exist
    long = [rng % 300 + 5 for rng in range(150)]
    llm.generate([short, long], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    reading = [drafts for chunk, drafts in steps if chunk]
    assert len(reading) >= 5 and not any(reading[1:])  # the first: both prompts, nothing to verify
    assert sum(drafts for chunk, drafts in steps if not chunk) > 0  # drafts again afterwards

def test_a_drafters_first_call_on_a_sequence_is_not_timed_as_drafting(tiny_llama):
    """The call that drafts a sequence's first tokens also feeds the drafter its prompt, once
    a sequence: its time is left out of the seconds a drafted token costs (the adaptive
    policy's drafting price); every call after it, on sequences already verified, counts."""
    llm = LLM(str(tiny_llama), num_kv_blocks=256, block_size=4,
              speculative_config={"method": "draft_model", "model": str(tiny_llama),
                                  "num_speculative_tokens": 2, "adaptive": False})
    runner = llm.engine.core.executor.worker.runner
    propose, observe = runner.proposer.propose, runner.draft_lengths.observe_drafting
    calls: list[list] = []  # [request ids, timed]

    def proposing(requests):
        calls.append([[r.request_id for r in requests], False])
        return propose(requests)

    def timed(seconds, tokens):
        calls[-1][1] = True
        return observe(seconds, tokens)

    runner.proposer.propose, runner.draft_lengths.observe_drafting = proposing, timed
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(repetitive_prompts(3, seed=5), params)
    seen: set[str] = set()
    for ids, was_timed in calls:
        assert was_timed == all(i in seen for i in ids), (ids, seen)
        seen.update(ids)
    assert sum(was_timed for _, was_timed in calls) >= len(calls) - 3


def test_a_step_no_draft_could_pay_for_asks_no_sequence(tiny_llama):
    """Where the draft-length policy says no sequence of a step could gain from drafts
    (``could_draft``: a full batch on compute-bound rows), the runner asks the proposer
    about none of them; the output is the same as without speculation."""
    llm = LLM(str(tiny_llama), speculative_config={**NGRAM, "adaptive": True},
              num_kv_blocks=256, block_size=4)
    runner = llm.engine.core.executor.worker.runner
    asked = []
    drafts_free = runner.proposer.drafts_free

    def asking(request_id, tokens):
        asked.append(request_id)
        return drafts_free(request_id, tokens)

    runner.proposer.drafts_free = asking
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    drafted = [o.metrics.num_draft_tokens for o in llm.generate(prompts, params)]
    assert asked and sum(drafted) > 0  # the policy's own answer: these repeats draft
    asked.clear()
    runner.draft_lengths.could_draft = lambda batch, rate: False
    outs = llm.generate(prompts, params)
    assert not asked and sum(o.metrics.num_draft_tokens for o in outs) == 0
    _, plain = run(tiny_llama, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
