"""What a loaded GGUF model keeps in memory: its quantized codes and a few floats a block, never a
float copy of a weight (benchmarks/memory.py measures the resident size this bounds), and the
quantized embedding gives the same greedy text as the float table it replaced."""

from __future__ import annotations

import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.kernels.cpu import quant_ops
from memwall.loader.model_loader import load_model
from memwall.quant import gguf_repack
from memwall.quant.base import QuantLinear
from memwall.quant.transform import EMBEDDING

needs_native = pytest.mark.skipif(not quant_ops.available(), reason="native kernels not built")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not), each storage once."""
    seen, out = set(), []
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append((name, t))
    return out


@needs_native
def test_no_float_copy_of_any_weight(gguf_path):
    loaded = load_model(str(gguf_path))
    model, arch = loaded.model, loaded.arch
    table = arch.vocab_size * arch.hidden_size
    floats = [(name, t) for name, t in _tensors(model) if t.is_floating_point()]
    # the largest float tensor allowed is a scale per 8 weights of the table (Q8_0: one per 32)
    big = [(name, tuple(t.shape)) for name, t in floats if t.numel() >= table // 8]
    assert not big, f"float tensors the size of a weight: {big}"
    # per quantized weight, at most two floats (scale and offset) a block of 16 values
    for name, layer in model.named_modules():
        if isinstance(layer, QuantLinear):
            weights = layer.out_features * layer.in_features
            float_bytes = sum(b.numel() * b.element_size() for b in layer.buffers()
                              if b.is_floating_point())
            assert float_bytes <= weights * 2 * 4 // 16, name
    # embedding and tied head: one set of codes
    assert model.model.embed_tokens.codes.data_ptr() == model.lm_head.codes.data_ptr()


@needs_native
def test_greedy_text_equals_the_float_embedding_path(gguf_path, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    quant = LLM(str(gguf_path), num_kv_blocks=32, max_model_len=256)
    quant_tokens = [o.outputs[0].token_ids for o in quant.generate(PROMPTS, params)]
    del quant
    # the path before QuantEmbedding: the table dequantized to a float nn.Embedding
    packed = []

    def float_embedding(*args, **kwargs):
        packed.append(original(*args, **kwargs, include_embedding=False))
        return packed[-1]

    original = gguf_repack.gguf_quantized_linears
    monkeypatch.setattr(gguf_repack, "gguf_quantized_linears", float_embedding)
    ref = LLM(str(gguf_path), num_kv_blocks=32, max_model_len=256)
    assert len(packed) == 1 and EMBEDDING not in packed[0] and "lm_head" in packed[0]
    ref_tokens = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    assert quant_tokens == ref_tokens
