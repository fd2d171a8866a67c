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
    assert "tensor parallel 2 (shared-memory all-reduce) x pipeline parallel 1" in described
    assert "decode steps fused in C" in described  # the C step ran with the all-reduce inside


def test_tp2_tokens_equal_tp1_embedded_gguf(gguf_path):
    one, _ = _generate(gguf_path)
    two, described = _generate(gguf_path, tensor_parallel_size=2)  # auto: the mp executor
    assert two == one
    assert "mp executor" in described and "rank 0: q heads 0-5, KV heads 0-1" in described
    assert "rank 1: q heads 6-8, KV heads 2-2, MLP columns 768-1535" in described


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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_pp2_and_tp2_x_pp2_tokens_equal_tp1(tiny_model_dir, kind):
    """Two stages (1 layer each), then 2 stages x 2 tensor ranks (4 processes): the same
    greedy and seeded tokens as one rank; several steps in flight (requests split between
    them) change nothing."""
    path = tiny_model_dir(kind)
    one, _ = _generate(path)
    pp, described = _generate(path, pipeline_parallel_size=2)
    assert pp == one
    assert "pipeline stage 0 of 2: layers 0-0 + embedding" in described
    assert "pipeline stage 1 of 2: layers 1-1 + LM head" in described
    both, described = _generate(path, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert both == one
    assert "4 ranks" in described and "rank 3: pipeline stage 1 of 2" in described


def test_pp2_embedded_gguf_balances_the_head(gguf_path):
    one, _ = _generate(gguf_path)
    pp, described = _generate(gguf_path, pipeline_parallel_size=2)
    assert pp == one
    # 30 layers, the 49k-row head weighing ~8 of them: the last stage gets fewer layers
    assert "stage 0 of 2: layers 0-18" in described and "stage 1 of 2: layers 19-29" in described
