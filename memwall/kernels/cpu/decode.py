"""The ctypes side of decode.c: ``NativeDecoder`` describes a Llama-family model (weights, KV
cache) to the C step once, then runs decode-only steps with one call each.

A model qualifies when it is float32 on the CPU and every projection is a float ``nn.Linear``,
a native quantized layer (``NativeQ4``/``NativeQ8``) or a ``ConcatLinear`` of those. Anything
else (bf16, torch's int4/int8 ops, no C compiler) makes ``NativeDecoder.build`` return None and
the model runs its torch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from memwall.quant import native

F32, Q4, Q8 = 1, 2, 3
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Part(ctypes.Structure):
    _fields_ = [("kind", _i32), ("group", _i32), ("n", _i64), ("k", _i64), ("w", _p),
                ("s", _p), ("c", _p), ("bias", _p)]


class Proj(ctypes.Structure):
    _fields_ = [("nparts", _i64), ("parts", Part * 3)]


class Layer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("k_cache", _p), ("v_cache", _p)]


class Model(ctypes.Structure):
    _fields_ = [("n_layers", _i64), ("hidden", _i64), ("n_heads", _i64), ("n_kv_heads", _i64),
                ("head_dim", _i64), ("inter", _i64), ("block_size", _i64), ("eps", _f32),
                ("scale", _f32), ("layers", ctypes.POINTER(Layer)), ("final_norm", _p)]


class Unsupported(Exception):
    """This model (or layer) has something decode.c does not compute."""


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise Unsupported(f"tensor of dtype {t.dtype} on {t.device} (contiguous {t.is_contiguous()})")
    return t.data_ptr()


def _part(module: nn.Module, bias: torch.Tensor | None = None) -> Part:
    from memwall.quant.base import QuantLinear
    from memwall.quant.int4_cpu import NativeQ4
    from memwall.quant.int8_cpu import NativeQ8

    bias = module.bias if bias is None else bias
    if type(module) is nn.Linear:
        return Part(F32, 0, module.out_features, module.in_features, _ptr(module.weight), None,
                    None, _ptr(bias))
    if isinstance(module, QuantLinear) and type(module.method) in (NativeQ4, NativeQ8):
        kind = Q4 if type(module.method) is NativeQ4 else Q8
        group = module.in_features // module.s.shape[1]
        return Part(kind, group if kind == Q8 else 32, module.out_features, module.in_features,
                    module.codes.data_ptr(), _ptr(module.s), _ptr(module.c), _ptr(bias))
    raise Unsupported(f"{type(module).__name__} ({getattr(module, 'method', '')})")


def _proj(module: nn.Module) -> Proj:
    from memwall.quant.transform import ConcatLinear

    if isinstance(module, ConcatLinear):
        if len(module.parts) > 3:
            raise Unsupported("a ConcatLinear of more than 3 parts")
        biases = (torch.split(module.bias, [p.out_features for p in module.parts])
                  if module.bias is not None else [None] * len(module.parts))
        parts = [_part(p, b.contiguous() if b is not None else None)
                 for p, b in zip(module.parts, biases)]
    else:
        parts = [_part(module)]
    proj = Proj(len(parts))
    for i, part in enumerate(parts):
        proj.parts[i] = part
    return proj


@dataclass
class NativeDecoder:
    """One model + KV cache described to decode.c. ``keep`` holds every tensor whose address
    the structs carry (split biases, the cos/sin tables), so none is freed under the C code."""

    model: Model
    layers: ctypes.Array
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    keep: list

    @classmethod
    def build(cls, net: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> "NativeDecoder | None":
        """None when the C step cannot run this model (see the module docstring)."""
        if not native.available():
            return None
        try:
            return cls._build(net, kv_caches)
        except Unsupported:
            return None

    @classmethod
    def _build(cls, net: nn.Module, kv_caches) -> "NativeDecoder":
        cfg, inner = net.config, net.model
        layers = (Layer * len(inner.layers))()
        keep: list = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(inner.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or mlp.gate_up_proj is None:
                raise Unsupported("projections are not fused")
            entry = layers[i]
            entry.in_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            if hasattr(attn, "q_norm"):
                entry.q_norm, entry.k_norm = _ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)
            for field, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                                  ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                proj = _proj(module)
                setattr(entry, field, proj)
                keep.append(module)  # owns the weights and biases the parts point into
            entry.k_cache, entry.v_cache = _ptr(k_cache), _ptr(v_cache)
        rotary = inner.rotary
        rope_cos, rope_sin = rotary.cos.float().contiguous(), rotary.sin.float().contiguous()
        eps = {layer.input_layernorm.eps for layer in inner.layers} | {inner.norm.eps}
        if len(eps) != 1:
            raise Unsupported("layers with different norm epsilons")
        model = Model(len(inner.layers), cfg.hidden_size, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                      kv_caches[0][0].shape[1], eps.pop(), inner.layers[0].self_attn.scale,
                      layers, _ptr(inner.norm.weight))
        return cls(model, layers, kv_caches, rope_cos, rope_sin, keep)

    def step(self, embeddings: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step for B sequences -> final-normed hidden states [B, hidden].

        embeddings [B, hidden] float32 (overwritten: it becomes the result), positions, slots,
        seq_lens int64 [B], block_tables int64 [B, width]."""
        x = embeddings.contiguous()
        b = x.shape[0]
        rc = native._lib().mw_decode_step(
            ctypes.byref(self.model), x.data_ptr(), b, positions.data_ptr(), slots.data_ptr(),
            seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            self.rope_cos.data_ptr(), self.rope_sin.data_ptr())
        if rc != 0:
            raise MemoryError("the native decode step could not allocate its buffers")
        return x


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """q [B, H, D] float32 -> [B, H, D]: each row attends over its sequence's blocks in place
    (no gather). block_tables int64 [B, width], seq_lens int64 [B]."""
    q = q.contiguous()
    b, h, d = q.shape
    out = torch.empty_like(q)
    native._lib().mw_paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), b, h, k_cache.shape[2], d, k_cache.shape[1],
        scale, out.data_ptr())
    return out
