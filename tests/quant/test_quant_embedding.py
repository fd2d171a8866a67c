"""QuantEmbedding: a lookup in a table kept quantized equals the float table's rows exactly,
for every GGUF type the native layouts hold, and on the embedded SmolLM2 (whose tied embedding
shares its lm_head's buffers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from memwall.loader.gguf_weights import dequantize
from memwall.kernels.cpu import quant_ops
from memwall.quant import QuantLinear
from memwall.quant.embedding import QuantEmbedding
from memwall.quant.gguf_repack import repack
from memwall.quant.int8_cpu import Int8WeightOnly

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loader"))
from test_gguf_dequant import random_blocks  # noqa: E402

needs_native = pytest.mark.skipif(not quant_ops.available(), reason="native kernels not built")


@needs_native
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0],
                         ids=lambda q: q.name)
def test_rows_equal_the_dequantized_table(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, hidden = 37, 2 * max(block, 64)
    raw = random_blocks(qtype, rows, hidden // block, seed=3)
    table = dequantize(raw, qtype, (rows, hidden))  # [rows, hidden], the float path
    embedding = QuantEmbedding(repack(raw, qtype, (rows, hidden), backend="native"))
    ids = torch.tensor([[5, 0, 36], [36, 5, 11]])
    got = embedding(ids)
    assert got.shape == (2, 3, hidden) and got.dtype == torch.float32
    assert torch.equal(got, table[ids])
    assert torch.equal(embedding(torch.arange(rows)), table)


def test_refuses_weights_it_cannot_read():
    with pytest.raises(ValueError, match="NativeQ4/NativeQ8"):
        QuantEmbedding(Int8WeightOnly().create_weights(torch.randn(32, 64)))


@needs_native
def test_embedded_model_keeps_its_embedding_quantized(gguf_path):
    from memwall.loader.model_loader import load_model

    quant = load_model(str(gguf_path)).model
    ref = load_model(str(gguf_path), quantization="none").model
    embedding, head = quant.model.embed_tokens, quant.lm_head
    assert isinstance(embedding, QuantEmbedding) and isinstance(head, QuantLinear)
    # one table for both: the tied head's buffers, not a copy
    assert embedding.codes.data_ptr() == head.codes.data_ptr()
    assert embedding.s.data_ptr() == head.s.data_ptr()
    assert not any(p.numel() >= embedding.num_embeddings for p in quant.parameters())
    table = ref.model.embed_tokens.weight
    ids = torch.arange(table.shape[0])
    assert torch.equal(embedding(ids), table)
