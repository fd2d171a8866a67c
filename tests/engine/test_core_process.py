"""The engine core in a process of its own (MPCoreClient): same tokens as in-process, aborts free
blocks, an idle core sleeps, load errors are one line, and a killed core is noticed at once."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import pytest

from memwall import SamplingParams
from memwall.config import EngineArgs
from memwall.engine.core_client import EngineCoreDeadError, EngineCoreStartError, MPCoreClient
from memwall.engine.llm_engine import LLMEngine
from memwall.loader.model_loader import load_tokenizer

ENGINE = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_num_seqs=6, threads=1)


@pytest.fixture(scope="module")
def args(tiny_model_dir):
    return EngineArgs(model=str(tiny_model_dir("llama")), **ENGINE)


@pytest.fixture(scope="module")
def engine(args):
    engine = LLMEngine(MPCoreClient(args), load_tokenizer(args.model))
    yield engine
    engine.shutdown()
    assert not engine.core.process.is_alive()


def run(engine: LLMEngine, prompts, params) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def _unmeasured(info):
    """The core's facts without the step budget's measured timings (they differ run to run)."""
    return dataclasses.replace(info, description=re.sub(r"\(measured here: [^)]*\)", "(measured)",
                                                        info.description))


def test_same_tokens_and_facts_as_in_process(engine, args):
    local = LLMEngine.from_args(args)
    assert _unmeasured(engine.core.info) == _unmeasured(local.core.info)
    assert engine.core.process.pid != os.getpid()
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9, 10, 11, 12], "def add(a, b):"]
    params = SamplingParams(max_tokens=10, n=2, seed=3, temperature=0.8, ignore_eos=True)
    remote, here = run(engine, prompts, params), run(local, prompts, params)
    for a, b in zip(remote, here):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    stats = engine.stats
    assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running


def test_abort_frees_blocks_and_the_stats_say_so(engine):
    engine.add_request("long", "Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
    while not engine.stats.num_running:
        engine.step()
    assert engine.stats.num_free_blocks < engine.stats.num_total_blocks
    engine.abort_request("long")
    outs = []
    while engine.has_unfinished_requests() or engine.core.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def test_idle_core_sleeps(engine):
    before = cpu_seconds(engine.core.process.pid)
    time.sleep(0.5)
    assert cpu_seconds(engine.core.process.pid) - before < 0.05  # blocked on its pipe: no polling


def test_load_error_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(EngineCoreStartError) as info:
        MPCoreClient(EngineArgs(model=str(bad), **ENGINE))
    message = str(info.value)
    assert "broken.gguf" in message and "not a GGUF file" in message and "\n" not in message


def test_a_killed_core_is_noticed_at_once(args):
    engine = LLMEngine(MPCoreClient(args), load_tokenizer(args.model))
    died = threading.Event()
    engine.core.on_death = died.set
    try:
        engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
        while not engine.stats.num_running:
            engine.step()
        os.kill(engine.core.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineCoreDeadError, match="killed by SIGKILL"):
            while True:
                engine.step()
        assert time.monotonic() - start < 2 and died.is_set()
        assert engine.core.has_unfinished_requests()  # and it keeps saying so: a death to report
        with pytest.raises(EngineCoreDeadError):
            engine.core.step()
        engine.add_request("b", "hi", SamplingParams(max_tokens=2))  # no error: step() reports
    finally:
        engine.shutdown()
