"""The EAGLE head: the published checkpoint layout loads (safetensors and pytorch_model.bin,
with or without the "model." prefix), a wrong directory is refused in one line, and its forward
over the paged cache equals Hugging Face's Llama decoder layer (input norm and final norm
removed) fed fc(cat(embedding, feature)), in a prefill chunk and a decode step after it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from memwall.attention.backend import get_backend
from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.spec_decode.eagle import EagleHeadError, load_eagle_head

HIDDEN = 64
CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=HIDDEN, intermediate_size=128,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, bias=True)


@pytest.fixture(scope="module")
def reference():
    """A 1-layer HF Llama with random weights and a random fc: the oracle and the checkpoint."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaModel(transformers.LlamaConfig(**{**CONFIG, "initializer_range": 0.2}))
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=True)
    weights = {f"layers.0.{k}": v.clone() for k, v in hf.layers[0].state_dict().items()}
    weights["layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)  # shipped, not applied
    weights["embed_tokens.weight"] = torch.randn(CONFIG["vocab_size"], HIDDEN)
    weights["fc.weight"], weights["fc.bias"] = fc.weight.detach().clone(), fc.bias.detach().clone()
    return hf.eval(), fc, weights


def write_head(directory, weights, fmt="safetensors", prefix=""):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    named = {prefix + k: v.contiguous() for k, v in weights.items()}
    if fmt == "safetensors":
        save_file(named, str(directory / "model.safetensors"))
    else:
        torch.save(named, directory / "pytorch_model.bin")
    return directory


def target_arch() -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict({**CONFIG, "num_hidden_layers": 30})


@torch.inference_mode()
@pytest.mark.parametrize("fmt, prefix", [("safetensors", ""), ("bin", "model.")])
def test_forward_equals_the_hf_decoder_layer(tmp_path, reference, fmt, prefix):
    hf, fc, weights = reference
    head = load_eagle_head(write_head(tmp_path / fmt, weights, fmt, prefix), target_arch())
    g = torch.Generator().manual_seed(1)
    T = 11
    embeds, features = torch.randn(T + 1, HIDDEN, generator=g), torch.randn(T + 1, HIDDEN, generator=g)
    want = hf(inputs_embeds=fc(torch.cat([embeds, features], -1))[None]).last_hidden_state[0]

    block_size, table = 4, [5, 2, 7, 0]
    shape = (8, block_size, CONFIG["num_key_value_heads"], HIDDEN // CONFIG["num_attention_heads"])
    caches = [(torch.zeros(shape), torch.zeros(shape))]
    backend = get_backend("torch")
    meta = AttentionMetadata.build([T], [T], [table], block_size, backend="torch")
    for module in head.modules():
        if hasattr(module, "attn_backend"):
            module.attn_backend = backend
    prefill = head(embeds[:T], features[:T], torch.arange(T), caches, meta)
    torch.testing.assert_close(prefill, want[:T], atol=1e-4, rtol=1e-4)
    meta = AttentionMetadata.build([1], [T + 1], [table], block_size, backend="torch")
    step = head(embeds[T:], features[T:], torch.tensor([T]), caches, meta)
    torch.testing.assert_close(step, want[T:], atol=1e-4, rtol=1e-4)


def test_wrong_directories_are_refused(tmp_path, reference):
    _, _, weights = reference
    with pytest.raises(EagleHeadError, match="no config.json"):
        load_eagle_head(tmp_path, target_arch())
    bad = dict(weights)
    del bad["fc.weight"]
    with pytest.raises(EagleHeadError, match="missing.*fc.weight"):
        load_eagle_head(write_head(tmp_path / "missing", bad), target_arch())
    other = ModelArchConfig.from_hf_dict({**CONFIG, "hidden_size": 128, "intermediate_size": 256})
    with pytest.raises(EagleHeadError, match="hidden size 64, the target's is 128"):
        load_eagle_head(write_head(tmp_path / "ok", weights), other)
    two = tmp_path / "two"
    write_head(two, weights)
    (two / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2}))
    with pytest.raises(EagleHeadError, match="one decoder layer"):
        load_eagle_head(two, target_arch())
