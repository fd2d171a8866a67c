"""Tensor-parallel sharding (memwall/distributed/tensor_parallel.py): the split itself, and a
sharded model's logits against the unsplit model's, with ranks as threads (thread_comm.py).
The same models through worker processes and the shared-memory all-reduce:
tests/distributed/test_mp_executor.py."""

from __future__ import annotations

import copy

import pytest
import torch

from memwall.distributed.tensor_parallel import ShardError, even_split, head_split, plan, shard_model
from tests.distributed.thread_comm import run_ranks
from tests.models.test_forward_parity import load_ours, run_chunks

IDS = [(i * 37 + 11) % 300 + 4 for i in range(40)]


def test_even_split_cuts_on_units_and_covers_everything():
    assert even_split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert even_split(96, 2, 32) == [(0, 64), (64, 96)]  # 3 blocks: 2 + 1
    with pytest.raises(ShardError, match="cannot be cut"):
        even_split(100, 2, 32)
    with pytest.raises(ShardError, match="over 4 ranks"):
        even_split(64, 4, 32)


def test_heads_split_by_kv_group_uneven_and_replicated():
    # SmolLM2: 9 q heads on 3 KV heads over 2 ranks: whole groups, 6 + 3
    assert head_split(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    # 4 q heads on 2 KV heads over 4 ranks: each KV head on 2 ranks, 1 q head each
    assert head_split(4, 2, 4) == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 3), (1, 2)),
                                   ((3, 4), (1, 2))]
    with pytest.raises(ShardError, match="tensor_parallel_size"):
        head_split(9, 3, 4)  # 4 ranks cannot share 3 KV heads of 3 q heads


def _sharded_logits(path, size: int, chunks: list[int]):
    model, arch = load_ours(path)
    model.fuse_projections()

    def rank(comm):
        net = copy.deepcopy(model)
        local = shard_model(net, comm)
        return run_chunks(net, local, IDS, chunks), local

    return model, arch, run_ranks(size, rank)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied", "gemma3"])
@pytest.mark.parametrize("size", [2, 4])
def test_sharded_model_logits_equal_the_unsplit_model(tiny_model_dir, kind, size):
    """Prefill in chunks and decode token by token through each rank's own KV cache: every
    rank's gathered logits equal the unsplit model's to float rounding (the all-reduce adds
    partial sums in another order), and all ranks agree bit for bit."""
    chunks = [13, 7, 20] if kind != "gemma3" else [25] + [1] * 15
    model, arch, results = _sharded_logits(tiny_model_dir(kind), size, chunks)
    reference = run_chunks(model, arch, IDS, chunks)
    for logits, local in results:
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits, results[0][0])
        assert local.num_key_value_heads == (1 if size >= 2 else 2)
    assert reference.argmax(-1).tolist() == results[0][0].argmax(-1).tolist()


def test_sharded_quantized_gguf_layers_keep_their_bits(tiny_model_dir):
    """A q4 (GGUF-native) and a q8 weight cut by rows and by whole scale blocks: each rank's
    slice dequantizes to exactly the unsplit weight's slice."""
    from memwall.distributed.tensor_parallel import take_columns, take_rows
    from memwall.quant.base import QuantLinear
    from memwall.quant.int4_cpu import NativeQ4
    from memwall.quant.int8_cpu import NativeQ8

    torch.manual_seed(0)
    w = torch.randn(48, 128)
    x = torch.randn(3, 128)
    for method in (NativeQ4(), NativeQ8(), NativeQ8(group_size=32)):  # the last: --quantization int8
        layer = QuantLinear(method.create_weights(w))
        full = layer(x)
        rows = torch.tensor([5, 0, 47, 12])
        assert torch.equal(take_rows(layer, rows)(x), full[:, rows])
        left = take_columns(layer, 0, 64, keep_bias=True)
        right = take_columns(layer, 64, 128, keep_bias=False)
        torch.testing.assert_close(left(x[:, :64]) + right(x[:, 64:]), full, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="cannot cut"):
            take_columns(layer, 0, 8 if isinstance(method, NativeQ8) and method.group_size is None
                         else 40, keep_bias=True)


def test_a_layout_that_cannot_be_cut_says_so():
    from memwall.distributed.tensor_parallel import take_columns
    from memwall.quant.base import QuantLinear
    from memwall.quant.int4_cpu import Int4WeightOnly

    layer = QuantLinear(Int4WeightOnly().create_weights(torch.randn(64, 128)))
    with pytest.raises(ShardError, match="--quantization"):
        take_columns(layer, 0, 64, keep_bias=True)


def test_plan_of_the_embedded_model_shape():
    from memwall.config import ModelArchConfig
    arch = ModelArchConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 8192, True)
    shards = plan(arch, 2, 32)
    assert [s.q_heads for s in shards] == [(0, 6), (6, 9)]
    assert [s.inter for s in shards] == [(0, 768), (768, 1536)]
    assert shards[0].vocab_sizes == (24576, 24576)


def test_a_pipeline_stage_reads_only_its_own_tensors(tiny_model_dir, gguf_path, monkeypatch):
    """The loader never decodes another stage's layers (nor the embedding or head it lacks);
    their modules stay unfilled for cut_stage to drop."""
    from memwall.distributed.pipeline import cut_stage, stage_of, stage_tensors
    from memwall.loader import gguf_loader
    from memwall.loader.model_loader import load_model
    from memwall.quant import gguf_repack

    seen: list[str] = []
    decode = gguf_repack.repack

    def spy(raw, qtype, shape, *a, **k):
        seen.append(shape)
        return decode(raw, qtype, shape, *a, **k)

    monkeypatch.setattr(gguf_repack, "repack", spy)
    full = load_model(gguf_path)
    everything = len(seen)
    seen.clear()
    stage = load_model(gguf_path, part=stage_tensors(1, 2))
    assert 0 < len(seen) < everything / 2  # layers 19-29 and the tied head of 30 layers
    arch = cut_stage(stage.model, stage_of(1, 2, stage.arch))
    assert arch.num_hidden_layers == 11
    import torch
    for mine, theirs in zip(stage.model.model.layers, list(full.model.model.layers)[19:]):
        assert torch.equal(mine.mlp.down_proj.codes, theirs.mlp.down_proj.codes)

    path = tiny_model_dir("llama")
    first = load_model(path, part=stage_tensors(0, 2))  # the untied head and norm: not read
    arch = cut_stage(first.model, stage_of(0, 2, first.arch))
    assert first.model.lm_head is None and first.model.model.norm is None
