"""Tensor parallel through worker processes (memwall/executor/multiproc.py): each rank a
process pinned to its core, calls broadcast through shared memory, the layers' partial sums
added by the shared-memory all-reduce, inside the fused C decode step too. Greedy and seeded
sampled tokens equal one rank's on the same float path."""

from __future__ import annotations

import os

import pytest

from memwall import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 23, 41], [7] * 3, list(range(4, 60))]  # 56 tokens: > 2 blocks of 16


def _generate(model, **kwargs):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
             **kwargs) as llm:
        outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:2], seeded)
        return [o.outputs[0].token_ids for o in outs], llm.engine.describe()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_tokens_equal_tp1_tiny_models(tiny_model_dir, kind):
    path = tiny_model_dir(kind)
    one, _ = _generate(path)
    two, described = _generate(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert two == one
    assert "tensor parallel 2 (shared-memory all-reduce)" in described
    assert "decode steps fused in C" in described  # the C step ran with the all-reduce inside


def test_tp2_tokens_equal_tp1_embedded_gguf(gguf_path):
    one, _ = _generate(gguf_path)
    two, described = _generate(gguf_path, tensor_parallel_size=2)  # auto: the mp executor
    assert two == one
    assert "mp executor" in described and "q heads 0-5" in described


def test_gloo_communicator_gives_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    one, _ = _generate(path)
    two, described = _generate(path, tensor_parallel_size=2, tp_comm="gloo")
    assert two == one
    assert "gloo all-reduce" in described


def test_no_rank_process_outlives_the_engine(tiny_model_dir):
    import psutil

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, tensor_parallel_size=2)
    ranks = [c for c in psutil.Process(os.getpid()).children()
             if "spawn_main" in " ".join(c.cmdline())]
    assert len(ranks) == 2
    llm.shutdown()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
