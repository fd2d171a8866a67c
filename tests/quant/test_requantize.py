"""A drafter's weights requantized to 4 bits at load (gguf_repack.requantize_to_q4; the
``requantize`` key of a draft_model speculative config): the weights memory keeps a byte a code
(Q5_0, Q8_0, Q6_K...) become Q4_0 / Q4_1 blocks of their decoded values, within half a 4-bit
step of them; the 4-bit types already packed two codes a byte are left as they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType, quants

from memwall.loader.errors import ModelLoadError
from memwall.loader.gguf_weights import dequantize
from memwall.loader.model_loader import load_model
from memwall.quant.gguf_repack import repack, requantize_to_q4


@pytest.mark.parametrize("source", [QType.Q8_0, QType.Q5_0, QType.Q5_1])  # gguf-py cannot make Q6_K
@pytest.mark.parametrize("target", [QType.Q4_0, QType.Q4_1])
def test_requantized_weight_is_within_half_a_step_of_the_decoded_one(source, target):
    rng = np.random.default_rng(int(source) * 7 + int(target))
    w = rng.standard_normal((32, 512)).astype(np.float32) * np.linspace(0.1, 3, 512, dtype=np.float32)
    raw = torch.from_numpy(quants.quantize(w, source))
    decoded = dequantize(raw.numpy(), source, w.shape).numpy().reshape(w.shape)
    blocks, qtype = requantize_to_q4(raw, source, w.shape, target)
    assert qtype == target and blocks.dtype == torch.uint8
    assert blocks.numel() == w.size // 32 * (18 if target == QType.Q4_0 else 20)  # 4.5 / 5 bits
    again = dequantize(blocks.numpy(), target, w.shape).numpy().reshape(w.shape)
    per_block = decoded.reshape(32, -1, 32)
    err = np.abs(again - decoded).reshape(32, -1, 32).max(-1)
    if target == QType.Q4_1:  # d = (max - min) / 15, values min + d q: half a step, plus the
        lo, hi = per_block.min(-1), per_block.max(-1)  # fp16 rounding of d and min
        bound = (hi - lo) / 30 + 2.0 ** -10 * (np.abs(lo) + hi - lo)
    else:  # ggml's Q4_0: d = the largest magnitude / 8, codes -8..7, so the far end clamps
        bound = np.abs(per_block).max(-1) / 8 * (1 + 2.0 ** -9)  # at 7d: up to one step off
    assert (err <= bound + 1e-6).all(), float((err / bound).max())
    weights = repack(blocks, qtype, w.shape)  # the kernels' 4-bit layout takes it
    assert weights is not None


def test_a_requantized_gguf_keeps_its_4_bit_weights_and_rounds_the_8_bit_ones(gguf_path):
    plain = load_model(gguf_path)
    cut = load_model(gguf_path, requantize="q4_1")
    # the embedded SmolLM2 is Q4_1 but for its tied Q8_0 embedding, which the LM head reads
    assert plain.model.lm_head.source == "gguf Q8_0" and cut.model.lm_head.source == "gguf Q4_1"
    layer, same = plain.model.model.layers[0].mlp.down_proj, cut.model.model.layers[0].mlp.down_proj
    assert layer.source == same.source == "gguf Q4_1"
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer(x), same(x))  # untouched
    h = torch.randn(2, 576, generator=torch.Generator().manual_seed(1))
    a, b = plain.model.lm_head(h), cut.model.lm_head(h)
    assert not torch.equal(a, b) and torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99


def test_requantize_is_refused_where_it_cannot_apply(gguf_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="requantize must be one of q4_0, q4_1"):
        load_model(gguf_path, requantize="q3_k")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(tiny_model_dir("llama"), requantize="q4_1")
    with pytest.raises(ModelLoadError, match="quantization 'auto'"):
        load_model(gguf_path, quantization="none", requantize="q4_1")
