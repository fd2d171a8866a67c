"""The Llama family: Llama 2/3 (incl. Llama-3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One class covers all four: they differ only in the flags of ``ModelArchConfig``. The model takes
a flat token axis (all sequences of the step concatenated) and a paged KV cache, so prefill
chunks and decodes share one forward pass. Parameter names are the Hugging Face ones, so a
checkpoint's tensors load by name.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from memwall.attention.backend import AttentionBackend, get_backend
from memwall.attention.metadata import AttentionMetadata
from memwall.config import ModelArchConfig
from memwall.kernels.cpu import elementwise
from memwall.layers.norm import RMSNorm
from memwall.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: K and V [num_blocks, block_size, kv_heads, head_dim]


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if cfg.qk_norm:  # Qwen3 normalizes each head's q and k before rotary
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None
        """q, k and v in one matmul, built by fuse_projections() after loading."""
        self.scale = cfg.attn_scale or self.head_dim ** -0.5
        self.window = cfg.layer_window(layer)
        """A sliding layer's window (Gemma); None: every earlier key."""
        self.softcap = cfg.attn_logit_softcap
        self.attn_backend: AttentionBackend | None = None
        """Bound once by the runner (memwall/attention/backend.py:bind); None: the backend
        that built the step's metadata."""

    def forward(self, x: torch.Tensor, rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(rope, q, k)
        backend = self.attn_backend or get_backend(meta.backend)
        backend.write_kv(kv_cache[0], kv_cache[1], k, v, meta)
        if self.window is None and self.softcap is None:
            o = backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        else:
            o = backend.forward(q, kv_cache[0], kv_cache[1], meta, self.scale, self.window,
                                self.softcap)
        return self.o_proj(o.reshape(tokens, self.num_heads * self.head_dim))


ACTIVATIONS = {"silu": nn.functional.silu,
               "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.act_name = act
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None
        """gate and up in one matmul, built by fuse_projections() after loading."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if (gate_up.dim() == 2 and self.act_name in elementwise.ACTS
                    and elementwise.usable(gate_up)):  # one pass in C
                return self.down_proj(elementwise.gated_act(gate_up, self.act_name))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        normed, x = self.post_attention_layernorm.add_and_norm(x, attn)  # x + attn, its norm
        return x + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden``: the previous pipeline stage's output instead of the embeddings; a stage
        without the final norm (not the last) returns its layers' output."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, hidden]
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x) if self.norm is not None else x


class LlamaForCausalLM(nn.Module):
    native_decode = True
    """memwall/kernels/cpu/decode.c computes this layout's decode step in one call."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """A tied head reads the embedding table (again after ``to_empty`` unties them)."""
        if self.config.tie_word_embeddings and type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (logits are taken separately).
        ``hidden``: a pipeline stage's input from the stage before (memwall/distributed)."""
        return self.model(input_ids, positions, kv_caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     absent: Iterable[str] = ()) -> None:
        """Copies checkpoint tensors in by HF name; a missing or misshapen tensor is an error,
        except the names in ``absent`` (weights the loader keeps quantized instead)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        offset = self.config.norm_weight_offset
        for name, tensor in _split_fused(weights, self.config):
            if offset and name.endswith("norm.weight"):
                tensor = tensor + offset  # Gemma stores w for (1 + w)
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints store the rope table; we compute our own
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = set(params) - loaded - tied - set(absent)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def fuse_projections(self) -> None:
        """q/k/v and gate/up become one matmul each: fewer, larger kernels per layer, which is
        what a decode step (one token, bandwidth bound, dispatch heavy) wants. Works on float
        Linears and on quantized ones (memwall/quant joins their packed rows)."""
        for layer in self.model.layers:
            fuse_layer_projections(layer)


def fuse_layer_projections(layer: "DecoderLayer") -> None:
    """One decoder layer's q/k/v and gate/up as one matmul each (``fuse_projections``; an
    EAGLE head's layer too)."""
    from memwall.quant.transform import concat_quantized
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv_proj = (_concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
                     or concat_quantized([attn.q_proj, attn.k_proj, attn.v_proj]))
    mlp.gate_up_proj = (_concat_linears([mlp.gate_proj, mlp.up_proj])
                        or concat_quantized([mlp.gate_proj, mlp.up_proj]))
    if attn.qkv_proj is not None:
        del attn.q_proj, attn.k_proj, attn.v_proj
    if mlp.gate_up_proj is not None:
        del mlp.gate_proj, mlp.up_proj


def _split_fused(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelArchConfig):
    """Phi-3 checkpoints hold q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj``:
    split into the separate projections this model loads (fuse_projections joins them again)."""
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, tensor in weights:
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            for part, t in zip("qkv", tensor.split([q_size, kv_size, kv_size])):
                yield f"{prefix}{part}_proj.weight", t
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.chunk(2)
            yield f"{prefix}gate_proj.weight", gate
            yield f"{prefix}up_proj.weight", up
        else:
            yield name, tensor


def _concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One Linear computing all parts' outputs side by side; None if they are not plain Linears."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    has_bias = parts[0].bias is not None
    fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=has_bias,
                      dtype=parts[0].weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(False)
    return fused
