"""The engine core's boundaries: only plain data crosses to the workers and to the API side.

A pickling executor sends every SchedulerOutput and RunnerOutput through pickle, as an executor
with workers in other processes must; the outputs must not change. The API side's metrics and
stop-string aborts are checked through the offline engine.
"""

from __future__ import annotations

import pickle

import pytest

from memwall import LLM, SamplingParams
from memwall.config import EngineArgs
from memwall.engine.core import EngineCore
from memwall.engine.llm_engine import LLMEngine
from memwall.executor.uniproc import UniProcExecutor

GREEDY = dict(temperature=0, ignore_eos=True)
ENGINE = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=24,
              max_num_seqs=6)


class PicklingExecutor(UniProcExecutor):
    """Every step's input and output make a round trip through pickle (a worker in another
    process sees exactly this); it also keeps what it saw for the assertions."""

    def __init__(self, args):
        super().__init__(args)
        self.seen = []

    def execute(self, sched):
        sched = pickle.loads(pickle.dumps(sched))
        self.seen.append(sched)
        return pickle.loads(pickle.dumps(super().execute(sched)))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def run(engine: LLMEngine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def test_pickled_steps_give_the_same_tokens_and_deltas_stay_small(model_dir):
    prompts = [list(range(5, 5 + n)) for n in (3, 30, 11, 17, 40)]  # two cross the 24-token budget
    params = SamplingParams(max_tokens=12, n=2, seed=7, temperature=0.8, ignore_eos=True)
    args = EngineArgs(model=model_dir, **ENGINE)
    plain = run(LLMEngine.from_args(args), prompts, params)
    executor = PicklingExecutor(args)
    core = EngineCore(args, executor)
    engine = LLMEngine(core, executor.worker.loaded.tokenizer)
    pickled = run(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in pickled] == \
        [[c.token_ids for c in o.outputs] for o in plain]
    # After its first appearance a request crosses as a delta: at most one new token per step.
    deltas = [d for s in executor.seen for d in s.cached_requests]
    assert deltas and all(len(d.new_token_ids) <= 1 for d in deltas)
    news = [d.request_id for s in executor.seen for d in s.new_requests]
    assert set(news) == {f"{i}/{j}" for i in range(len(prompts)) for j in range(2)}
    finished = {rid for s in executor.seen for rid in s.finished_ids}
    assert finished <= set(news)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_request_metrics_are_filled_in_order(model_dir):
    llm = LLM(model_dir, **ENGINE)
    [out] = llm.generate([list(range(5, 40))], SamplingParams(max_tokens=5, **GREEDY))
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_in_queue >= 0 and m.time_to_first_token > 0


def test_stop_string_aborts_the_sample_in_the_core_and_frees_its_blocks(model_dir):
    llm = LLM(model_dir, **ENGINE)
    params = SamplingParams(max_tokens=30, **GREEDY)
    full = llm.generate(["hello world"], params)[0].outputs[0]
    stop = full.text[4:7]
    assert stop.strip(), "the tiny model's text was expected to have a few characters here"
    out = llm.generate(["hello world"], SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0]
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert len(sample.token_ids) < len(full.token_ids)
    assert not llm.engine.core.has_unfinished_requests()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_total_blocks
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks  # the stats say so too
