"""Data parallel (memwall/engine/dp_client.py): two engine replicas behind one LLMEngine give a
single engine's greedy tokens, keep a shared prefix on one replica (its second request hits the
cache), send an abort where its request runs, die together, and leave no process behind.

Each core process costs seconds to start, so one DP=2 client serves the module; the start-up
plan, the stats merge and a failed start are checked without processes."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from memwall import SamplingParams
from memwall.config import EngineArgs
from memwall.engine.core_client import EngineCoreDeadError, EngineCoreStartError
from memwall.engine.dp_client import DPCoreClient, merge_stats, plan_replicas
from memwall.engine.llm_engine import LLMEngine
from memwall.engine.protocol import AdapterCounters, EngineStats, LoRAStatsSnapshot

ENGINE = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=6, threads=1)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = [5 + (i * 7) % 300 for i in range(40)]  # 10 blocks of 4 tokens


@pytest.fixture(scope="module")
def args(tiny_model_dir):
    return EngineArgs(model=str(tiny_model_dir("llama")), data_parallel_size=2, **ENGINE)


@pytest.fixture(scope="module")
def engine(args):
    engine = LLMEngine.from_args(args)
    assert isinstance(engine.core, DPCoreClient)
    yield engine
    engine.shutdown()
    assert not any(p.is_alive() for p in engine.core.processes)


def run(engine: LLMEngine, prompts: dict, params: SamplingParams = GREEDY) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return drain(engine)


def drain(engine: LLMEngine) -> dict:
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_greedy_tokens_equal_a_single_engine(engine, args):
    single = LLMEngine.from_args(dataclasses.replace(args, data_parallel_size=1))
    prompts = {str(i): p for i, p in enumerate(
        ["The quick brown fox", [5, 6, 7, 8, 9, 10, 11, 12], "def add(a, b):", "Once upon a time",
         "Paged attention keeps", LONG, "Caf\u00e9 na\u00efve"])}
    ours, theirs = run(engine, prompts), run(single, prompts)
    assert [ours[i].outputs[0].token_ids for i in prompts] == \
           [theirs[i].outputs[0].token_ids for i in prompts]
    assert min(engine.core.router.stats().routed) >= 1  # both replicas took part
    assert "data parallel 2" in engine.describe()
    stats = engine.core.stats()
    assert stats.num_total_blocks == 2 * 64 and stats.num_free_blocks == stats.num_total_blocks


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(engine):
    router = engine.core.router
    shared = [7 + (i * 11) % 300 for i in range(40)]  # seen by neither replica yet
    engine.add_request("first", shared + [1, 2], GREEDY)
    replica = router.replica_of("first")
    first = drain(engine)["first"]
    engine.add_request("second", shared + [3, 4, 5], GREEDY)  # round robin alone: the other one
    assert router.replica_of("second") == replica
    second = drain(engine)["second"]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= len(shared) - 4


def test_an_abort_reaches_the_replica_running_it(engine):
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    engine.add_request("a", [100 + i for i in range(6)], long)
    engine.add_request("b", [200 + i for i in range(6)], long)  # new prompts: one replica each
    ra, rb = engine.core.router.replica_of("a"), engine.core.router.replica_of("b")
    assert {ra, rb} == {0, 1}
    replicas = engine.core.replicas
    while not all(r.stats().num_running for r in replicas):
        engine.step()
    engine.abort_request("a")
    outs = []
    while replicas[ra].stats().num_running or replicas[ra].has_unfinished_requests():
        outs += engine.step()
    assert replicas[ra].stats().num_free_blocks == replicas[ra].stats().num_total_blocks
    assert replicas[rb].stats().num_running == 1  # the other request runs on
    finals = [o for o in outs if o.request_id == "a" and o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["abort"]
    done = drain(engine)
    assert done["b"].outputs[0].finish_reason == "length"
    assert engine.core.router.stats().in_flight == (0, 0)


def test_the_dashboard_watches_replica_0(engine):
    core = engine.core
    assert core.live is core.replicas[0].live
    engine.set_watched(True)  # only replica 0 is told: its map is the one the page shows
    run(engine, {f"w{i}": [300 + 5 * i + j for j in range(6)] for i in range(4)})
    view = core.live.view
    assert view is not None and len(view.states) == 64  # one replica's blocks, not both
    assert core.live.steps() and core.replicas[1].live.view is None
    engine.set_watched(False)


# Last of the tests on the module's client: it kills one of its replicas (a fresh client would
# cost another few seconds of start-up).
def test_a_dead_replica_takes_the_client_down(engine):
    died = threading.Event()
    engine.core.on_death = died.set
    engine.add_request("doomed", "Once upon a time",
                       SamplingParams(max_tokens=100, ignore_eos=True))
    victim = engine.core.router.replica_of("doomed")
    while not engine.stats.num_running:
        engine.step()
    os.kill(engine.core.processes[victim].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineCoreDeadError, match="killed by SIGKILL"):
        while time.monotonic() - start < 5:
            engine.step()
    assert died.is_set() and engine.core.has_unfinished_requests()  # it keeps saying so
    engine.shutdown()
    assert not any(p.is_alive() for p in engine.core.processes)  # the live replica too


# ---- without processes ----------------------------------------------------------------------
def test_the_plan_splits_cores_threads_and_kv_memory():
    args = EngineArgs(data_parallel_size=2, kv_cache_memory=1 << 30)
    plans = plan_replicas(args, [0, 1, 2, 3, 4])
    assert [p.cpus for p in plans] == [(0, 1), (2, 3)]  # core 4 goes unused: even shares
    assert all(p.args.threads == 2 and p.args.data_parallel_size == 1 for p in plans)
    assert plans[0].args.kv_cache_memory == 1 << 29
    fraction = plan_replicas(EngineArgs(data_parallel_size=4, threads=3), [0, 1])
    assert [p.cpus for p in fraction] == [None] * 4  # fewer cores than replicas: no pinning
    assert fraction[0].args.threads == 3  # the user's --threads wins
    assert fraction[0].args.kv_cache_fraction == pytest.approx(0.25 / 4)
    assert fraction[0].args.gpu_memory_utilization == pytest.approx(0.9 / 4)


def test_stats_sum_and_rates_are_ratios_of_sums():
    for f in dataclasses.fields(EngineStats):  # a new field that does not add up needs handling
        assert f.name == "lora" or f.type == "int", f"merge_stats cannot sum {f.name}: {f.type}"
    a = EngineStats(num_running=2, num_free_blocks=10, num_total_blocks=64,
                    prefix_cache_queries=100, prefix_cache_hits=90)
    b = EngineStats(num_running=1, num_waiting=3, num_free_blocks=64, num_total_blocks=64,
                    prefix_cache_queries=300, prefix_cache_hits=30)
    merged = merge_stats([a, b])
    assert (merged.num_running, merged.num_waiting, merged.num_total_blocks) == (3, 3, 128)
    assert merged.prefix_cache_hit_rate == pytest.approx(120 / 400)  # not the mean of 0.9 and 0.1
    assert merged.kv_cache_usage == pytest.approx(1 - 74 / 128)
    assert merged.lora is None
    lora_a = LoRAStatsSnapshot(loads=1, resident=1, adapters=(AdapterCounters("x", 2, 1, 10, 5),))
    lora_b = LoRAStatsSnapshot(loads=2, resident=1, adapters=(AdapterCounters("x", 1, 1, 10, 0),
                                                              AdapterCounters("y", 4)))
    merged = merge_stats([dataclasses.replace(a, lora=lora_a), dataclasses.replace(b, lora=lora_b)])
    assert merged.lora.loads == 3 and merged.lora.resident == 2
    assert merged.lora.adapters == (AdapterCounters("x", 3, 2, 20, 5), AdapterCounters("y", 4))


class _FakeReplica:
    closed = False

    def shutdown(self, timeout: float = 0) -> None:
        self.closed = True


def test_a_failed_start_names_the_replica_and_stops_the_others():
    lock, started = threading.Lock(), []

    def start(args, cpus):  # called from the replicas' start threads
        with lock:
            started.append(_FakeReplica())
            if len(started) == 2:
                raise EngineCoreStartError("cannot read model.gguf")
            return started[-1]

    with pytest.raises(EngineCoreStartError, match=r"replica \d: cannot read model.gguf"):
        DPCoreClient(EngineArgs(data_parallel_size=3), start=start)
    assert len(started) == 3 and started[0].closed and started[2].closed
