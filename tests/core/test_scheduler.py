"""Scheduler behaviour with a fake runner: no model, milliseconds per test."""

from memwall.config import SchedulerConfig
from memwall.core.kv.manager import KVCacheManager
from memwall.core.scheduler import Scheduler
from memwall.core.step import RunnerOutput, SampledToken
from memwall.request import Request, RequestStatus
from memwall.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=1024,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv), kv


def req(rid, prompt_len, max_tokens=4, **params):
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                   max_tokens=max_tokens, eos_token_ids=frozenset({2}))


class Chunk:
    """One scheduled request of a plain SchedulerOutput, read back for assertions."""

    def __init__(self, request, start, num_tokens):
        self.request, self.start, self.num_tokens = request, start, num_tokens
        self.samples = start + num_tokens == request.num_tokens


def chunks(sched, out):
    starts = {d.request_id: d.num_computed_tokens for d in [*out.new_requests, *out.cached_requests]}
    return [Chunk(sched.requests[rid], starts[rid], n) for rid, n in out.num_scheduled_tokens.items()]


class Step:
    """A SchedulerOutput with its chunks read back before the results were applied."""

    def __init__(self, out, chunk_list):
        self.out, self.chunks = out, chunk_list
        self.preempted_ids = out.preempted_ids


def fake_step(sched, token=7):
    out = sched.schedule()
    chunk_list = chunks(sched, out)
    result = RunnerOutput(sampled={c.request.request_id: SampledToken(token)
                                   for c in chunk_list if c.samples})
    sched.update(out, result)
    return Step(out, chunk_list)


def test_chunked_prefill_respects_token_budget_and_decodes_join():
    sched, _ = make_scheduler(budget=10)
    long, short = req("long", 25), req("short", 3)
    sched.add(long)
    out = fake_step(sched)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("long", 0, 10)]
    sched.add(short)
    out = fake_step(sched)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("long", 10)]
    out = fake_step(sched)  # long finishes its prompt (5) and short prefills alongside (3)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("long", 5), ("short", 3)]
    assert long.output_token_ids == [7] and short.output_token_ids == [7]
    out = fake_step(sched)  # both decode in one step
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("long", 1), ("short", 1)]


def test_without_chunking_a_prompt_over_budget_waits():
    sched, _ = make_scheduler(budget=8, chunked=False)
    sched.add(req("a", 6))
    sched.add(req("b", 6))
    out = fake_step(sched)
    assert [c.request.request_id for c in out.chunks] == ["a"]


def test_max_num_seqs_limits_running():
    sched, _ = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add(req(str(i), 2))
    out = fake_step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 1


def test_preemption_by_recompute_frees_newest_and_requeues_it_first():
    # 4 blocks of 4 tokens: two 7-token prompts fit (2 blocks each); growing past 8 tokens
    # needs a 3rd block for one of them, so the newer one is preempted.
    sched, kv = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a, b = req("a", 7, max_tokens=6), req("b", 7, max_tokens=6)
    sched.add(a)
    sched.add(b)
    fake_step(sched)  # both prefill 7 tokens (2 blocks each) and sample an 8th
    fake_step(sched)  # the 8th token's KV still fits in block 2
    out = fake_step(sched)  # a's 9th token needs a 3rd block -> b is preempted
    assert out.preempted_ids == ["b"] and b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and sched.waiting.peek() is b
    assert len(b.output_token_ids) == 2  # its tokens are kept and recomputed as prompt later
    while sched.has_unfinished:
        fake_step(sched)
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert kv.num_free_blocks == 4 and b.num_preemptions >= 1


def test_stop_conditions_eos_stop_token_min_tokens_and_length():
    sched, kv = make_scheduler()
    eos = req("eos", 3, max_tokens=10)
    sched.add(eos)
    fake_step(sched, token=2)
    assert eos.status is RequestStatus.FINISHED_STOPPED
    stop_tok = req("stop", 3, max_tokens=10, stop_token_ids=[9])
    sched.add(stop_tok)
    fake_step(sched, token=9)
    assert stop_tok.status is RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 9
    ignore = req("ign", 3, max_tokens=3, ignore_eos=True)
    sched.add(ignore)
    for _ in range(3):
        fake_step(sched, token=2)
    assert ignore.status is RequestStatus.FINISHED_LENGTH and ignore.output_token_ids == [2, 2, 2]
    min_tok = req("min", 3, max_tokens=5, min_tokens=2)
    sched.add(min_tok)
    fake_step(sched, token=2)  # the sampler masks EOS before min_tokens; even if it came, no stop
    assert not min_tok.is_finished
    fake_step(sched, token=2)
    assert min_tok.status is RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.num_total_blocks


def test_abort_anywhere_frees_blocks():
    sched, kv = make_scheduler(max_seqs=1)
    running, waiting = req("r", 9), req("w", 5)
    sched.add(running)
    sched.add(waiting)
    fake_step(sched)
    assert sched.abort("r") is running and sched.abort("w") is waiting
    assert running.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("nope") is None
    assert not sched.has_unfinished and kv.num_free_blocks == kv.num_total_blocks


def test_oldest_request_always_progresses_under_pressure():
    """Many requests, a tiny pool: everything finishes (no starvation, no deadlock)."""
    sched, kv = make_scheduler(num_blocks=6, block_size=4, budget=16, max_seqs=8)
    reqs = [req(str(i), 3 + i % 5, max_tokens=8) for i in range(12)]
    for r in reqs:
        sched.add(r)
    for _ in range(500):
        if not sched.has_unfinished:
            break
        fake_step(sched)
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert kv.num_free_blocks == 6


def test_step_is_plain_data_sent_whole_once_then_as_deltas():
    import pickle

    sched, kv = make_scheduler(block_size=4, budget=32)
    sched.add(req("a", 6, max_tokens=4))
    first = fake_step(sched).out
    assert [d.request_id for d in first.new_requests] == ["a"] and not first.cached_requests
    new = first.new_requests[0]
    assert new.prompt_token_ids == list(range(10, 16)) and new.block_ids == kv.block_table("a")[:2]
    second = fake_step(sched).out  # "a" sampled 7 last step; its 7th token starts block 2
    assert not second.new_requests
    [delta] = second.cached_requests
    assert (delta.new_token_ids, delta.num_computed_tokens) == ([7], 6)
    assert delta.new_block_ids == []  # 7 tokens still fit 2 blocks of 4
    fake_step(sched)  # position 7 still fits block 1
    fourth = fake_step(sched).out  # position 8 is the first of block 2
    [grown] = fourth.cached_requests[0].new_block_ids
    assert grown not in new.block_ids
    assert pickle.loads(pickle.dumps(fourth)) == fourth  # nothing live crosses the boundary
    sched.add(req("b", 3))
    fifth = fake_step(sched).out  # "a" finished (4 tokens) in the last update
    assert fifth.finished_ids == ["a"] and [d.request_id for d in fifth.new_requests] == ["b"]


def test_preempted_request_is_sent_whole_again_when_it_resumes():
    sched, kv = make_scheduler(num_blocks=4, block_size=4, budget=64, max_seqs=4)
    sched.add(req("old", 7, max_tokens=8))
    sched.add(req("new", 7, max_tokens=8))
    fake_step(sched)
    preempted = []
    for _ in range(12):
        step = fake_step(sched)
        preempted += step.out.preempted_ids
        resumed = [d for d in step.out.new_requests if d.request_id in preempted]
        if resumed:
            data = resumed[0]  # its outputs so far, and only what the prefix cache still holds
            assert data.output_token_ids and data.num_computed_tokens % 4 == 0
            assert data.num_computed_tokens < len(data.prompt_token_ids) + len(data.output_token_ids)
            return
    raise AssertionError(f"expected a preemption and a resume, got preempted={preempted}")
