"""A tensor-parallel rank's loader reads only its slice of each tensor
(``load_model(tensor_parallel=rank_layout(rank, size))``, memwall/loader/slicing.py): the model
it builds equals, tensor for tensor, the whole model loaded and then cut (``shard_model``), for
float checkpoints (fused Phi-3 ones included), GGUF files of mixed types (q/k rows permuted on
disk) and a K-quant weight cut between its 256-value blocks; and the bytes the ranks read
together are the file's tensor bytes once, not once per rank."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from memwall.distributed.tensor_parallel import rank_layout, shard_model
from memwall.loader import gguf_file
from memwall.loader.model_loader import load_model
from tests.loader.test_gguf_loader import hf_weights, write_gguf


@dataclass
class NoComm:
    """Cutting a model needs only the rank and size; no collective runs here."""

    rank: int
    size: int


def _state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {n: t for n, t in net.state_dict(keep_vars=False).items()}
    return {n: (t.float() if t.is_floating_point() else t) for n, t in state.items()}


def assert_same_model(sliced: torch.nn.Module, cut: torch.nn.Module) -> None:
    a, b = _state(sliced), _state(cut)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
        assert a[name].dtype == b[name].dtype or a[name].is_floating_point(), name
    assert not hasattr(sliced, "tp_layout")


def sliced_and_cut(path, rank: int, size: int, **kwargs):
    """(the rank's model read as its slice, the whole model loaded then cut), both sharded."""
    sliced = load_model(path, tensor_parallel=rank_layout(rank, size), **kwargs)
    assert sliced.model.tp_layout.shard.rank == rank
    arch_a = shard_model(sliced.model, NoComm(rank, size))
    whole = load_model(path, **kwargs)
    arch_b = shard_model(whole.model, NoComm(rank, size))
    assert arch_a == arch_b
    assert sliced.arch == whole.arch  # what the worker reports: the whole model's
    return sliced.model, whole.model


@pytest.mark.parametrize("kind,size", [("llama", 2), ("llama", 4), ("qwen2", 2),
                                       ("llama_tied", 2), ("gemma3", 2), ("phi3", 2)])
def test_a_rank_reads_exactly_its_cut_of_a_float_checkpoint(tiny_model_dir, kind, size):
    path = tiny_model_dir(kind)
    for rank in range(size):
        sliced, cut = sliced_and_cut(path, rank, size)
        assert_same_model(sliced, cut)


class ByteCount:
    """Bytes read from GGUF files, split into whole-tensor reads of 2-D weights and row reads."""

    def __init__(self, monkeypatch) -> None:
        self.rows = 0
        self.whole_2d = 0
        read_rows, data = gguf_file.Tensor.read_rows, gguf_file.Tensor.data.fget

        def counted_rows(t, rows, byte_range=None):
            out = read_rows(t, rows, byte_range)
            self.rows += out.nbytes
            return out

        def counted_data(t):
            out = data(t)
            if len(t.shape) == 2:
                self.whole_2d += out.nbytes
            return out

        monkeypatch.setattr(gguf_file.Tensor, "read_rows", counted_rows)
        monkeypatch.setattr(gguf_file.Tensor, "data", property(counted_data))


def weight_bytes(path) -> int:
    return sum(t.n_bytes for t in gguf_file.GGUFFile(path).tensors if len(t.shape) == 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_rank_reads_its_slice_of_a_mixed_type_gguf(tmp_path, monkeypatch, arch, quantization):
    """F32, F16, BF16, Q4_0, Q4_1 and Q8_0 tensors, llama's q/k rows permuted on disk, qwen2's
    q/k/v biases; kept quantized ("auto") or dequantized ("none")."""
    path = write_gguf(tmp_path / f"{arch}.gguf", hf_weights(3, arch=arch), arch=arch)
    counter = ByteCount(monkeypatch)
    read = 0
    for rank in range(2):
        sliced = load_model(path, quantization=quantization, tensor_parallel=rank_layout(rank, 2))
        read += counter.rows
        assert counter.whole_2d == 0  # no weight matrix read whole
        counter.rows = 0
        shard_model(sliced.model, NoComm(rank, 2))
        whole = load_model(path, quantization=quantization)
        shard_model(whole.model, NoComm(rank, 2))
        assert_same_model(sliced.model, whole.model)
        counter.rows = counter.whole_2d = 0
    assert read == weight_bytes(path)  # every matrix byte read once over both ranks


def _q4_k_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K blocks (144 bytes a 256 values) with finite fp16 d and dmin."""
    raw = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    for offset in (0, 2):
        d = rng.uniform(1e-3, 1e-2, raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_a_k_quant_weight_cut_between_its_blocks(tmp_path):
    """12 heads of 64 on 6 KV heads over 2 ranks: o_proj's inputs are cut at 384, inside a
    256-value Q4_K block, so that rank reads whole rows and cuts the repacked layout's 32-value
    groups; the down projection's cut (256) falls on the blocks and is read alone."""
    hidden, heads, kv, ffn, vocab = 768, 12, 6, 512, 64
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "qwen2")
    w.add_name("k")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def f32(name, shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    def q4k(name, rows, cols):
        w.add_tensor(name, _q4_k_blocks(rng, rows, cols), raw_dtype=Q.Q4_K)

    f32("token_embd.weight", (vocab, hidden))
    f32("output_norm.weight", (hidden,))
    f32("output.weight", (vocab, hidden))
    f32("blk.0.attn_norm.weight", (hidden,))
    f32("blk.0.ffn_norm.weight", (hidden,))
    for name, rows in (("attn_q", heads * 64), ("attn_k", kv * 64), ("attn_v", kv * 64)):
        q4k(f"blk.0.{name}.weight", rows, hidden)
        f32(f"blk.0.{name}.bias", (rows,))
    q4k("blk.0.attn_output.weight", hidden, heads * 64)
    q4k("blk.0.ffn_gate.weight", ffn, hidden)
    q4k("blk.0.ffn_up.weight", ffn, hidden)
    q4k("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for rank in range(2):
        sliced, cut = sliced_and_cut(tmp_path / "k.gguf", rank, 2)
        assert sliced.model.layers[0].self_attn.o_proj.inner.in_features == 384
        assert_same_model(sliced, cut)


def test_the_embedded_model_ranks_read_half_each(gguf_path, monkeypatch):
    """SmolLM2 (Q4_1, a Q8_0 tied embedding) over 2 ranks: 6 + 3 q heads, 768 MLP columns and
    24,576 vocabulary rows each; each rank reads well under the whole file, both together its
    matrices once, and rank 1's model is the whole model's cut."""
    counter = ByteCount(monkeypatch)
    total = weight_bytes(gguf_path)
    reads = []
    for rank in range(2):
        load_model(gguf_path, tensor_parallel=rank_layout(rank, 2))
        assert counter.whole_2d == 0
        reads.append(counter.rows)
        counter.rows = 0
    assert sum(reads) == total
    assert max(reads) < 0.6 * total
    sliced, cut = sliced_and_cut(gguf_path, 1, 2)
    assert_same_model(sliced, cut)
