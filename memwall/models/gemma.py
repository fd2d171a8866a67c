"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences, each a flag of
``ModelArchConfig`` (memwall/config.py):

    embeddings    x = embed(ids) * sqrt(hidden)
    norms         four a layer ("sandwich"): input, post-attention (on the attention's output),
                  pre-feedforward, post-feedforward; weights stored as w for (1 + w)
    attention     q/k norm (Gemma 3); scale query_pre_attn_scalar ** -0.5; sliding layers attend
                  the last ``sliding_window`` keys (Gemma 2 every other layer, Gemma 3 five of
                  six) with their own rope base (Gemma 3: 10k local, 1M global); Gemma 2 caps
                  attention scores and final logits with cap * tanh(x / cap)
    MLP           GeGLU: gelu(gate, tanh approximation) * up

Attention, MLP and the weight loading are the Llama family's (memwall/models/llama.py); the
decoder layer and the model differ. The fused CPU decode step (decode.c) computes Gemma 3's
decode steps too, its sliding layers attending their window at any length; for Gemma 2
(soft-capped scores) this forward runs them (its matmuls still the native kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.layers.norm import RMSNorm
from memwall.layers.rotary import RotaryEmbedding
from memwall.models.llama import MLP, Attention, KVCache, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.local_rope = cfg.layer_window(layer) is not None and cfg.rope_local_theta is not None

    def forward(self, x, ropes, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        rope = ropes[1] if self.local_rope else ropes[0]
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                             cfg.rope_local_theta, None)
                             if cfg.rope_local_theta is not None else None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.embed_scale or 1.0
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            x = self.embed_tokens(input_ids)  # [T, hidden]
            # the scale rounded to the compute dtype first, as in transformers
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:  # a later pipeline stage: the previous stage's output
            x = hidden
        ropes = (self.rotary.lookup(positions, x.dtype),
                 self.local_rotary.lookup(positions, x.dtype) if self.local_rotary else None)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, meta)
        return self.norm(x) if self.norm is not None else x


class GemmaForCausalLM(LlamaForCausalLM):
    native_decode = True  # decode.c has Gemma's norms, GeGLU and per-layer rope (not softcaps)

    def __init__(self, cfg: ModelArchConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
