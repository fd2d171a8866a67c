"""Tensor parallel through Ray actors (memwall/executor/ray_executor.py) on a local Ray
instance: the same tokens as one rank, the ranks' shared-memory all-reduce chosen because both
actors landed on this host, nothing left behind by a shutdown, and a killed rank failing the
next step at once; pipeline stages (PP=2, TP=2 x PP=2) handing hidden states on as Ray objects.
(Ranks on two hosts, over gloo: scripts/test-multihost.)"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the ray executor needs Ray: pip install 'ray>=2.40'")

from memwall import LLM, SamplingParams  # noqa: E402
from memwall.executor import RankFailed  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray instance, then engines of two actors: ~25 s

PROMPTS = [[5, 17, 99, 23, 41], [7] * 3, list(range(4, 60))]  # 56 tokens: > 2 blocks of 16
ENGINE = dict(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
RAY_TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """A Ray instance of this test's own (the executor joins it and leaves it running)."""
    # 4 logical CPUs on this 2-core box: room for TP=2 x PP=2 ranks of one thread each
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _generate(model, **kwargs):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    with LLM(str(model), **ENGINE, **kwargs) as llm:
        outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:2], seeded)
        return [o.outputs[0].token_ids for o in outs], llm.engine.describe()


def _live_rank_actors() -> list:
    # the public state API (ray.util.state) asks the dashboard, which this Ray runs without
    from ray._private.state import actors
    return [a for a in actors().values()
            if a["ActorClassName"] == "RankActor" and a["State"] != "DEAD"]


def _placement_groups_left() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_tp2_tokens_equal_tp1_and_shutdown_leaves_nothing(tiny_model_dir):
    path = tiny_model_dir("llama")
    one, _ = _generate(path)
    two, described = _generate(path, **RAY_TP2)
    assert two == one
    # both actors on this host: the shared-memory all-reduce
    assert ("2 ranks as Ray actors (ray executor) on 1 node(s): tensor parallel 2 "
            "(shared-memory all-reduce)") in described
    assert "rank 1: q heads 2-3" in described
    assert ray.is_initialized()  # the test's Ray is not the executor's to stop
    deadline = time.monotonic() + 10  # ray.kill is asynchronous
    while _live_rank_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_rank_actors() == []
    assert _placement_groups_left() == []


def test_gloo_between_actors_gives_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    one, _ = _generate(path)
    two, described = _generate(path, **RAY_TP2, tp_comm="gloo")
    assert two == one
    assert "gloo all-reduce" in described


def test_a_killed_rank_fails_the_next_step(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), **ENGINE, **RAY_TP2)
    executor = llm.engine.core.executor
    ray.kill(executor._actors[1])
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 died"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert time.monotonic() - start < 5  # not the 120 s collective timeout
    with pytest.raises(RankFailed, match="the worker group is down"):
        executor.execute(None)
    assert _placement_groups_left() == []  # the failure tore the group down
    llm.shutdown()


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_stages_as_actors_give_the_same_tokens(tiny_model_dir, tp, pp):
    """Stages hand their hidden states on through Ray's object store, steps overlapping (one a
    stage in flight); greedy and seeded tokens equal one rank's."""
    path = tiny_model_dir("llama")
    one, _ = _generate(path)
    staged, described = _generate(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  distributed_executor_backend="ray", threads=1)
    assert staged == one
    assert (f"{tp * pp} ranks as Ray actors (ray executor) on 1 node(s): tensor parallel {tp}"
            in described)
    assert f"x pipeline parallel {pp}" in described
    assert f"rank {tp}: pipeline stage 1 of 2" in described
