"""EAGLE-style draft heads (Li et al., EAGLE-1/2 layout): one Llama decoder layer that drafts
in the target's feature space.

    feature f_t   the target's last hidden state at position t (after its final norm)
    input t       fc(cat(embed(x_{t+1}), f_t))          embed: the target's token embedding
    layer         one decoder layer, no input norm (the fc output goes in as it is)
    output        a predicted f_{t+1}; the target's LM head turns it into the draft x_{t+2},
                  and (embed(x_{t+2}), predicted f_{t+1}) is the next input

Published checkpoints (e.g. yuhuili/EAGLE-llama2-chat-7B) are a directory with a Llama
``config.json`` (``num_hidden_layers`` 1) and ``fc.weight`` [H, 2H] (``fc.bias`` when
``bias`` is set), ``layers.0.*`` in the Hugging Face names, optionally ``embed_tokens.weight``
(a copy of the target's, not used) and ``layers.0.input_layernorm.weight`` (not applied in
layer 0), in ``model.safetensors`` or ``pytorch_model.bin``. ``load_eagle_head`` reads that
layout; ``benchmarks/train_eagle.py`` is to write it.

This module is the head itself; the proposer that feeds it the target's features step by step
is not built yet (issue 15).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.layers.rotary import RotaryEmbedding
from memwall.models.llama import DecoderLayer, KVCache

UNUSED = ("embed_tokens.weight", "layers.0.input_layernorm.weight")


class EagleHeadError(ValueError):
    """A directory that is not an EAGLE head for this target (one line, for users)."""


class EagleHead(nn.Module):
    def __init__(self, arch: ModelArchConfig, fc_bias: bool) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.config = arch
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(arch)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """token_embeds, features [T, H] (x_{t+1}'s embedding and f_t), positions [T] (t) ->
        predicted features [T, H] (f_{t+1}), the K/V of each t written to the head's cache."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return x


def load_eagle_head(directory: str | Path, target: ModelArchConfig,
                    dtype: torch.dtype = torch.float32) -> EagleHead:
    """An EAGLE-1/2 head directory -> EagleHead, checked against the target's shape."""
    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EagleHeadError(f"{path} has no config.json: not an EAGLE head directory")
    config = json.loads(config_file.read_text())
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise EagleHeadError(f"{path}: an EAGLE head has one decoder layer, this config has {layers}")
    arch = ModelArchConfig.from_hf_dict({**config, "model_type": config.get("model_type", "llama")})
    if arch.hidden_size != target.hidden_size:
        raise EagleHeadError(f"{path}: hidden size {arch.hidden_size}, the target's is "
                             f"{target.hidden_size}: a head drafts for the model it was trained on")
    weights = _read_weights(path)
    head = EagleHead(arch, fc_bias="fc.bias" in weights)
    params = dict(head.named_parameters())
    missing = sorted(set(params) - set(weights))
    unknown = sorted(set(weights) - set(params) - set(UNUSED))
    if missing or unknown:
        raise EagleHeadError(f"{path}: not the EAGLE head layout (missing {missing[:3]}, "
                             f"unexpected {unknown[:3]})")
    for name, param in params.items():
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise EagleHeadError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
        param.data.copy_(tensor)
    return head.to(dtype).eval()


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = path / "model.safetensors", path / "pytorch_model.bin"
    if safetensors_file.is_file():
        from safetensors.torch import load_file
        weights = load_file(str(safetensors_file))
    elif bin_file.is_file():
        weights = torch.load(bin_file, map_location="cpu", weights_only=True)  # no pickled code
    else:
        raise EagleHeadError(f"{path} has neither model.safetensors nor pytorch_model.bin")
    # some exports prefix the names as a submodule of the target ("model.")
    return {name.removeprefix("model."): tensor.float() for name, tensor in weights.items()}
