"""Speculative decoding in the scheduler, with a fake worker: drafts join a decode within the
budget and max_tokens, accepted drafts become tokens, blocks only rejected drafts filled go
back, and thousands of accept/reject cycles with aborts and preemption leak no block."""

from __future__ import annotations

import random
from collections import Counter

from memwall.config import SchedulerConfig
from memwall.core.kv.manager import KVCacheManager, blocks_needed
from memwall.core.scheduler import Scheduler
from memwall.core.step import RunnerOutput, SampledToken
from memwall.request import Request
from memwall.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, preemption="recompute",
         max_spec_batch=None, swap_blocks=0):
    kv = KVCacheManager(num_blocks, block_size, num_swap_blocks=swap_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=1024,
                          preemption_mode=preemption, max_spec_batch=max_spec_batch)
    return Scheduler(cfg, kv), kv


def req(rid, prompt_len, max_tokens=50):
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, eos_token_ids=frozenset({2}))


class WorkerTables:
    """The block tables a worker would hold, rebuilt from the SchedulerOutputs alone."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, out):
        for rid in out.finished_ids + out.preempted_ids:
            self.tables.pop(rid, None)
        for new in out.new_requests:
            self.tables[new.request_id] = list(new.block_ids)
        for c in out.cached_requests:
            table = self.tables[c.request_id]
            keep = len(table) if c.num_blocks < 0 else c.num_blocks - len(c.new_block_ids)
            self.tables[c.request_id] = table[:keep] + list(c.new_block_ids)


def step(sched, accept, drafts_for, token=7, worker=None):
    """One step; ``accept(rid, drafts) -> how many are accepted``; ``drafts_for(rid)``: the
    worker's proposals for next step. ``worker``: a WorkerTables checked against the KV
    manager (what the worker reads must be the blocks the request holds)."""
    out = sched.schedule()
    if worker is not None:
        worker.apply(out)
        for rid in out.num_scheduled_tokens:
            assert worker.tables[rid] == sched.kv.block_table(rid), rid
    result = RunnerOutput()
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[rid]
        drafts = out.spec_token_ids.get(rid, [])
        start = request.num_computed_tokens
        if start + n - len(drafts) != request.num_tokens:
            continue  # a prefill chunk that does not reach the end samples nothing
        a = accept(rid, drafts)
        result.accepted_drafts[rid] = [SampledToken(t) for t in drafts[:a]]
        result.sampled[rid] = SampledToken(token)
        result.draft_token_ids[rid] = drafts_for(rid)
    sched.update(out, result)
    return out


def test_drafts_join_the_decode_and_accepted_ones_become_tokens():
    sched, kv = make()
    r = req("a", 6)
    sched.add(r)
    step(sched, lambda rid, d: 0, lambda rid: [40, 41, 42])  # prefill; proposes 3 drafts
    assert r.output_token_ids == [7] and r.spec_token_ids == [40, 41, 42]
    out = step(sched, lambda rid, d: 2, lambda rid: [50])
    assert out.spec_token_ids == {"a": [40, 41, 42]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert r.output_token_ids == [7, 40, 41, 7]
    assert r.num_computed_tokens == r.num_tokens - 1  # the sampled token's KV comes next step
    assert (r.num_draft_tokens, r.num_accepted_tokens, r.num_verify_steps) == (3, 2, 1)
    assert len(kv.block_table("a")) == blocks_needed(r.num_tokens, kv.block_size)


def test_rejected_drafts_give_back_the_blocks_only_they_filled():
    sched, kv = make(block_size=4)
    r = req("a", 4)  # prompt fills one block exactly
    sched.add(r)
    step(sched, lambda rid, d: 0, lambda rid: [1] * 7)
    free_before = kv.num_free_blocks
    out = step(sched, lambda rid, d: 0, lambda rid: [])  # 1 + 7 tokens at positions 4..11
    assert out.num_scheduled_tokens == {"a": 8}
    assert len(kv.block_table("a")) == blocks_needed(r.num_tokens, 4) == 2
    assert kv.num_free_blocks == free_before - 1


def test_drafts_respect_budget_and_max_tokens_and_batch_limit():
    sched, _ = make(budget=3)
    r = req("a", 3, max_tokens=10)
    sched.add(r)
    step(sched, lambda rid, d: 0, lambda rid: [1, 2, 3, 4, 5])
    out = step(sched, lambda rid, d: len(d), lambda rid: [1, 2, 3, 4, 5])
    assert out.spec_token_ids["a"] == [1, 2]  # budget 3 = the last token + 2 drafts
    sched2, _ = make()
    r2 = req("b", 3, max_tokens=3)
    sched2.add(r2)
    step(sched2, lambda rid, d: 0, lambda rid: [1, 2, 3, 4])
    out = step(sched2, lambda rid, d: len(d), lambda rid: [1, 2])
    assert out.spec_token_ids["b"] == [1]  # 1 output so far + 1 draft + 1 sampled = 3
    assert r2.num_output_tokens == 3 and r2.is_finished
    sched3, _ = make(max_spec_batch=1)
    for rid in ("c", "d"):
        sched3.add(req(rid, 3))
    step(sched3, lambda rid, d: 0, lambda rid: [1, 2])
    out = step(sched3, lambda rid, d: 0, lambda rid: [1, 2])
    assert out.spec_token_ids == {}  # two running sequences > max_spec_batch


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    sched, kv = make()
    r = req("a", 5)
    sched.add(r)
    step(sched, lambda rid, d: 0, lambda rid: [30, 2, 31])  # 2 is EOS
    step(sched, lambda rid, d: 3, lambda rid: [])
    assert r.output_token_ids == [7, 30, 2] and r.is_finished
    assert kv.num_free_blocks == kv.num_total_blocks


def test_thousands_of_accept_reject_cycles_with_aborts_and_preemption_leak_nothing():
    for mode in ("recompute", "swap"):
        rng = random.Random(3)
        sched, kv = make(num_blocks=40, block_size=4, budget=24, max_seqs=6, preemption=mode,
                         swap_blocks=64 if mode == "swap" else 0)
        next_id, verified, preempted = 0, 0, 0
        worker = WorkerTables()
        for _ in range(2500):
            while len(sched.requests) < 8:
                sched.add(req(f"r{next_id}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 40)))
                next_id += 1
            if rng.random() < 0.03 and sched.requests:
                sched.abort(rng.choice(list(sched.requests)))
            out = step(sched, lambda rid, d: rng.randrange(len(d) + 1),
                       lambda rid: [rng.randrange(3, 99) for _ in range(rng.randrange(0, 6))],
                       worker=worker)
            verified += len(out.spec_token_ids)
            preempted += len(out.preempted_ids)
            for rid, table in kv.block_tables.items():  # no request holds more than it needs
                r = sched.requests[rid]
                assert len(table) <= blocks_needed(r.num_tokens + 5, kv.block_size) + 1
            refs = Counter(b for t in kv.block_tables.values() for b in t)
            assert refs == {b: c for b, c in enumerate(kv.pool.ref_counts) if c > 0}
            assert kv.num_free_blocks == kv.num_total_blocks - len(refs)
        for rid in list(sched.requests):
            sched.abort(rid)
        assert verified > 1000 and preempted > 10, (verified, preempted)
        assert kv.num_free_blocks == kv.num_total_blocks
        assert kv.swap_pool is None or kv.swap_pool.num_free_blocks == kv.swap_pool.num_blocks
