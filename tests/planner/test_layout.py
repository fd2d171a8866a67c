"""Tensor/pipeline cuts: the planner's pure-Python copies agree with memwall/distributed/."""

from __future__ import annotations

import pytest

from memwall.planner.layout import Layout, rank_share, stage_layers
from memwall.planner.shapes import BUILTIN


def _arch(name: str):
    from memwall.config import ModelArchConfig

    s = BUILTIN[name]
    return ModelArchConfig.from_hf_dict({
        "num_hidden_layers": s.layers, "hidden_size": s.hidden, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "intermediate_size": s.intermediate, "vocab_size": s.vocab})


@pytest.mark.parametrize("name", ["llama-3-70b", "smollm2-135m", "qwen2.5-7b", "gemma-3-1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stages_are_the_engines(name: str, stages: int) -> None:
    from memwall.distributed.pipeline import stage_layers as engine_stage_layers

    assert stage_layers(BUILTIN[name], stages) == engine_stage_layers(_arch(name), stages)


@pytest.mark.parametrize("name, tp", [("llama-3-70b", 8), ("llama-3-70b", 16), ("smollm2-135m", 3),
                                      ("qwen2.5-7b", 2), ("qwen2.5-0.5b", 2), ("llama-3-8b", 4)])
def test_rank_heads_are_the_engines(name: str, tp: int) -> None:
    from memwall.distributed.tensor_parallel import plan

    shards = plan(_arch(name), tp)
    share = rank_share(BUILTIN[name], tp)
    assert share.heads == max(s.q_heads[1] - s.q_heads[0] for s in shards)
    assert share.kv_heads == max(s.kv_heads[1] - s.kv_heads[0] for s in shards)
    assert share.intermediate == max(s.inter[1] - s.inter[0] for s in shards)


def test_kv_heads_replicate_beyond_their_count() -> None:
    share = rank_share(BUILTIN["llama-3-70b"], 16)  # 8 KV heads on 16 ranks: each twice
    assert (share.heads, share.kv_heads) == (4, 1)
    assert share.layer_fraction > 1 / 16  # the replicated k/v weights cost extra


def test_impossible_cuts_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="cannot be shared by 12 ranks"):
        rank_share(BUILTIN["llama-3-8b"], 12)
    with pytest.raises(ValueError, match="need at least 40 layers"):
        stage_layers(BUILTIN["llama-3-8b"], 40)
    with pytest.raises(ValueError, match="give a multiple of 4 GPUs"):
        Layout(2, 2, 6)
    assert Layout(2, 1, 8).replicas == 4
