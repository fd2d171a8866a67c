"""The ctypes side of decode.c: ``NativeDecoder`` describes a Llama-family model (weights, KV
cache) to the C step once, then runs decode-only steps with one call each; and
``paged_decode_attention``, paged_attention.c's kernel on its own.

A model qualifies when it is float32 on the CPU (its KV cache may be any format of
memwall/attention/kv_quant.py) and every projection is one the kernels can read (layout.py ``describe``: a float ``nn.Linear``, or a module whose ``native_parts()`` gives
up to 3 q4/q8/f32 parts). Anything else (bf16, torch's int4/int8 ops, no C compiler) makes
``NativeDecoder.build`` return None and the model runs its torch path, which computes the same
thing.

Tensor parallel: a model cut by memwall/distributed/tensor_parallel.py is described by its
rank's share, and decode.c sums the o and down projections over the ranks through the model's
communicator (``native_all_reduce``: shared memory, or a callback into torch.distributed).

LoRA: projections wrapped by ``memwall.lora.layers.apply_lora`` are described by their base,
and their ``LoRASlots`` segments go to decode.c too, which adds each token's adapter delta
after the projection (``step``'s ``token_slots``), as the wrapped modules do in torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from memwall.attention import kv_quant
from memwall.kernels.cpu import build
from memwall.kernels.cpu.layout import LayoutError, PackedWeight, describe
from memwall.lora.layers import unwrap

KINDS = {"f32": 1, "q4": 2, "q8": 3, "panels": 4}  # MW_F32, MW_Q4, MW_Q8, MW_PANELS in decode.c
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Part(ctypes.Structure):
    _fields_ = [("kind", _i32), ("group", _i32), ("n", _i64), ("k", _i64), ("w", _p),
                ("s", _p), ("c", _p), ("bias", _p), ("half", _i64)]


class Proj(ctypes.Structure):
    _fields_ = [("nparts", _i64), ("parts", Part * 3)]


class LoRASeg(ctypes.Structure):
    _fields_ = [("col", _i64), ("n", _i64), ("k", _i64), ("a", _p), ("bt", _p), ("rank", _p)]


class LoRAProj(ctypes.Structure):
    _fields_ = [("nsegs", _i64), ("segs", LoRASeg * 3)]


class Layer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p),
                ("attn_out_norm", _p), ("ffn_out_norm", _p), ("rope_cos", _p), ("rope_sin", _p),
                ("lora_qkv", LoRAProj), ("lora_o", LoRAProj), ("lora_gate_up", LoRAProj),
                ("lora_down", LoRAProj), ("window", _i64)]


class Model(ctypes.Structure):
    _fields_ = [("n_layers", _i64), ("hidden", _i64), ("n_heads", _i64), ("n_kv_heads", _i64),
                ("head_dim", _i64), ("inter", _i64), ("block_size", _i64), ("n_blocks", _i64),
                ("max_positions", _i64), ("kv_type", _i64), ("eps", _f32), ("scale", _f32),
                ("layers", ctypes.POINTER(Layer)), ("final_norm", _p), ("act", _i64),
                ("max_rank", _i64), ("n_slots", _i64), ("allreduce", _p), ("comm_ctx", _p)]


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # MW_ACT_* in decode.c


class Unsupported(Exception):
    """This model (or layer) has something decode.c does not compute."""


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise Unsupported(f"tensor of dtype {t.dtype} on {t.device} (contiguous {t.is_contiguous()})")
    return t.data_ptr()


def _part(weight: PackedWeight) -> Part:
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    half = weight.flags if weight.kind == "panels" else weight.scale_format  # mw_part.half
    return Part(KINDS[weight.kind], weight.group, weight.n, weight.k, weight.codes.data_ptr(),
                ptr(weight.scales), ptr(weight.offsets), ptr(weight.bias), int(half))


def _proj(module: nn.Module, keep: list) -> Proj:
    """One projection's parts (layout.py ``describe``), their tensors appended to ``keep``."""
    try:
        parts = describe(module)
    except LayoutError as e:
        raise Unsupported(f"{type(module).__name__}: {e}") from e
    if not parts:
        raise Unsupported(f"{type(module).__name__} ({getattr(module, 'method', '')})")
    if len(parts) > 3:
        raise Unsupported(f"a projection of {len(parts)} parts (decode.c takes up to 3)")
    keep.append(parts)  # owns the split biases the parts point into
    proj = Proj(len(parts))
    for i, part in enumerate(parts):
        proj.parts[i] = _part(part)
    return proj


def _lora(segments: list, proj: Proj, geometry: set, keep: list) -> LoRAProj:
    """A projection's LoRA segments (memwall/lora/slots.py ``SlotSegment``) for decode.c, their
    tensors appended to ``keep``; each segment's (max_loras, max_rank) is added to ``geometry``
    (decode.c takes one for the whole model). Unsupported when they do not fit ``proj``."""
    if len(segments) > 3:
        raise Unsupported(f"{len(segments)} LoRA targets in one projection (decode.c takes 3)")
    lora = LoRAProj(len(segments))
    k = proj.parts[0].k
    out = sum(proj.parts[i].n for i in range(proj.nparts))
    end = 0
    for i, seg in enumerate(sorted(segments, key=lambda seg: seg.col)):
        slots, rank, n = seg.a.shape[0], seg.a.shape[1], seg.bt.shape[2]
        if (seg.a.shape[2] != k or tuple(seg.bt.shape) != (slots, rank, n) or seg.col < end
                or seg.col + n > out or tuple(seg.rank.shape) != (slots,)):
            raise Unsupported(f"LoRA target {seg.target}: a {list(seg.a.shape)}, bt "
                              f"{list(seg.bt.shape)} at column {seg.col} do not fit a "
                              f"projection of {k} inputs and {out} outputs")
        if seg.rank.dtype != torch.int32 or not seg.rank.is_contiguous() or seg.rank.device.type != "cpu":
            raise Unsupported(f"LoRA ranks of {seg.rank.dtype} on {seg.rank.device}")
        end = seg.col + n
        geometry.add((slots, rank))
        keep += [seg.a, seg.bt, seg.rank]  # the slots' own tensors: loading an adapter is seen
        lora.segs[i] = LoRASeg(seg.col, n, k, _ptr(seg.a), _ptr(seg.bt), seg.rank.data_ptr())
    return lora


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
        if not build.available():
            return None
        try:
            return cls._build(net, kv_caches)
        except Unsupported:
            return None

    @classmethod
    def _build(cls, net: nn.Module, kv_caches) -> "NativeDecoder":
        cfg, inner = net.config, net.model
        if not getattr(net, "native_decode", False):
            raise Unsupported(f"{type(net).__name__} is not a layout decode.c computes")
        if cfg.attn_logit_softcap is not None or cfg.hidden_act not in ACTIVATIONS:
            raise Unsupported("soft-capped attention scores or another activation")
        if len(kv_caches) != len(inner.layers):
            raise Unsupported(f"{len(kv_caches)} KV caches for {len(inner.layers)} layers")
        cache_shape = tuple(kv_caches[0][0].shape)  # [num_blocks, block_size, kv_heads, head_dim]
        if cache_shape[2:] != (cfg.num_key_value_heads, cfg.head_dim):
            raise Unsupported(f"a KV cache of shape {cache_shape}")
        kv_dtype = kv_caches[0][0].dtype
        if kv_dtype not in kv_quant.NATIVE_CODES:
            raise Unsupported(f"a KV cache of {kv_dtype}")
        layers = (Layer * len(inner.layers))()
        keep: list = []
        geometry: set[tuple[int, int]] = set()  # LoRA (max_loras, max_rank) of every segment
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(inner.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or mlp.gate_up_proj is None:
                raise Unsupported("projections are not fused")
            entry = layers[i]
            # an EAGLE head's layer has no input norm (nn.Identity): the C step then skips it
            entry.in_norm = _ptr(getattr(layer.input_layernorm, "weight", None))
            if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
                entry.attn_out_norm = _ptr(layer.post_attention_layernorm.weight)
                entry.post_norm = _ptr(layer.pre_feedforward_layernorm.weight)
                entry.ffn_out_norm = _ptr(layer.post_feedforward_layernorm.weight)
            else:
                entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            if getattr(layer, "local_rope", False):  # Gemma 3's sliding layers: their own base
                local = inner.local_rotary
                cos, sin = local.cos.float().contiguous(), local.sin.float().contiguous()
                keep += [cos, sin]
                entry.rope_cos, entry.rope_sin = cos.data_ptr(), sin.data_ptr()
            if hasattr(attn, "q_norm"):
                entry.q_norm, entry.k_norm = _ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)
            entry.window = getattr(attn, "window", None) or 0  # a sliding layer's (Gemma)
            for field, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                                  ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                base, segments = unwrap(getattr(module, "inner", module))  # row-parallel: its
                # own share (the step all-reduces after o and down); LoRA: base and segments
                proj = _proj(base, keep)
                setattr(entry, field, proj)
                setattr(entry, "lora_" + field, _lora(segments, proj, geometry, keep))
                keep.append(module)  # owns the weights the parts point into
            if tuple(k_cache.shape) != cache_shape or tuple(v_cache.shape) != cache_shape:
                raise Unsupported("KV caches of different shapes")
            if k_cache.dtype != kv_dtype or v_cache.dtype != kv_dtype:
                raise Unsupported("KV caches of different formats")
            entry.k_cache, entry.k_scale = _cache_ptrs(k_cache)
            entry.v_cache, entry.v_scale = _cache_ptrs(v_cache)
        rotary = inner.rotary
        rope_cos, rope_sin = rotary.cos.float().contiguous(), rotary.sin.float().contiguous()
        eps = {norm.eps for layer in inner.layers
               for norm in (layer.input_layernorm, layer.post_attention_layernorm) if hasattr(norm, "eps")}
        final_norm = None  # a pipeline stage before the last has none (memwall/distributed)
        if inner.norm is not None:
            eps.add(inner.norm.eps)
            final_norm = _ptr(inner.norm.weight)
        if len(eps) != 1:
            raise Unsupported("layers with different norm epsilons")
        if len(geometry) > 1:
            raise Unsupported(f"LoRA slots of different sizes {sorted(geometry)}")
        n_slots, max_rank = geometry.pop() if geometry else (0, 0)
        model = Model(len(inner.layers), cfg.hidden_size, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                      cache_shape[1], cache_shape[0], rope_cos.shape[0],
                      kv_quant.NATIVE_CODES[kv_dtype], eps.pop(),
                      inner.layers[0].self_attn.scale, layers, final_norm,
                      ACTIVATIONS[cfg.hidden_act], max_rank, n_slots)
        comm = getattr(net, "tp_comm", None)  # tensor parallel: memwall/distributed
        if comm is not None:
            native = comm.native_all_reduce()
            if native is None:
                raise Unsupported(f"{type(comm).__name__} has no all-reduce decode.c can call")
            model.allreduce, model.comm_ctx = native
            keep.append(comm)
        return cls(model, layers, kv_caches, rope_cos, rope_sin, keep)

    def step(self, embeddings: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             seq_lens: torch.Tensor, block_tables: torch.Tensor,
             token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for B sequences -> final-normed hidden states [B, hidden].

        embeddings [B, hidden] float32 (overwritten: it becomes the result), positions, slots,
        seq_lens int64 [B], block_tables int64 [B, width]; token_slots int32 [B], each
        sequence's LoRA slot (-1: the base model), or None: no LoRA. B may be 0 (returns
        [0, hidden]). Inputs that point outside the model (a position past its rotary tables,
        a slot or block outside the KV cache, a length the table cannot hold, a LoRA slot
        outside -1..max_loras - 1) raise ValueError, and the step changes nothing."""
        hidden = self.model.hidden
        if embeddings.dim() != 2 or embeddings.shape[1] != hidden or embeddings.dtype != torch.float32:
            raise ValueError(f"embeddings must be float32 [B, {hidden}], got {embeddings.dtype} "
                             f"{list(embeddings.shape)}")
        x = embeddings.contiguous()
        b = x.shape[0]
        if b == 0:
            return x
        positions, slots = _indices(positions, "positions", b), _indices(slots, "slots", b)
        seq_lens, tables = _indices(seq_lens, "seq_lens", b), _indices(block_tables, "block_tables", b, 2)
        if token_slots is not None:
            token_slots = _indices(token_slots, "token_slots", b, dtype=torch.int32)
        rc = build.require().mw_decode_step(
            ctypes.byref(self.model), x.data_ptr(), b, positions.data_ptr(), slots.data_ptr(),
            seq_lens.data_ptr(), tables.data_ptr(), tables.shape[1], self.rope_cos.data_ptr(),
            self.rope_sin.data_ptr(), None if token_slots is None else token_slots.data_ptr())
        build.raise_for(rc, "the native decode step")
        return x


def _indices(t: torch.Tensor, name: str, rows: int, dims: int = 1,
             dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``t`` as the contiguous int64 (or ``dtype``) CPU tensor [rows, ...] the kernels read;
    ValueError else."""
    if t.dtype != dtype or t.device.type != "cpu" or t.dim() != dims or t.shape[0] != rows:
        raise ValueError(f"{name} must be an {str(dtype).removeprefix('torch.')} CPU tensor of "
                         f"{dims} dim(s) with {rows} rows, got {t.dtype} {list(t.shape)} on {t.device}")
    return t.contiguous()


def _cache_ptrs(cache: torch.Tensor) -> tuple[int, int | None]:
    """(data, scales or None) addresses of a contiguous CPU KV cache in a native format."""
    if cache.dtype not in kv_quant.NATIVE_CODES or not cache.is_contiguous() or cache.device.type != "cpu":
        raise Unsupported(f"a KV cache of {cache.dtype} on {cache.device} "
                          f"(contiguous {cache.is_contiguous()})")
    scales = kv_quant.scales_of(cache)
    if kv_quant.has_scales(cache.dtype) and (scales is None or not scales.is_contiguous()):
        raise Unsupported("an int8 KV cache without its contiguous scales")
    return cache.data_ptr(), _ptr(scales)


def _check_attention(q: torch.Tensor, rows: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     where: str) -> tuple[int, int, int]:
    """q's (rows, heads, head_dim) when q is float32 [rows, H, D] and the caches are contiguous
    [blocks, block_size, kv_heads, D] of one native format whose kv_heads divide H; else
    ValueError saying which."""
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be float32 [{rows}, heads, head_dim], got {q.dtype} {list(q.shape)}")
    n, h, d = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.dim() != 4 or cache.shape[3] != d or cache.shape != k_cache.shape
                or cache.dtype != k_cache.dtype or not cache.is_contiguous()):
            raise ValueError(f"{name} must be contiguous [blocks, block_size, kv_heads, {d}] of "
                             f"k_cache's dtype, got {cache.dtype} {list(cache.shape)}")
    try:
        _cache_ptrs(k_cache), _cache_ptrs(v_cache)
    except Unsupported as e:
        raise ValueError(f"{where} cannot read {e}; formats: "
                         f"{', '.join(map(str, kv_quant.NATIVE_CODES))}") from e
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or h % kv_heads:
        raise ValueError(f"{h} query heads cannot share {kv_heads} KV heads evenly")
    return n, h, d


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """q [B, H, D] float32 -> [B, H, D]: each row attends over its sequence's blocks in place
    (no gather). k_cache, v_cache [num_blocks, block_size, kv_heads, D] of one format of
    kv_quant.NATIVE_CODES (int8 with its scales attached), H a multiple of kv_heads;
    block_tables int64 [B, width], seq_lens int64 [B] in 1..width * block_size; ``window``: a
    sliding layer's, each row then attends its last ``window`` keys. Anything else raises
    ValueError before C runs; B = 0 returns [0, H, D]."""
    b, h, d = _check_attention(q, "B", k_cache, v_cache, "paged_decode_attention")
    (k_ptr, ks_ptr), (v_ptr, vs_ptr) = _cache_ptrs(k_cache), _cache_ptrs(v_cache)
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty(b, h, d, dtype=torch.float32)
    if b == 0:
        return out
    q = q.contiguous()
    tables, lens = _indices(block_tables, "block_tables", b, 2), _indices(seq_lens, "seq_lens", b)
    rc = build.require().mw_paged_decode_attention_kv(
        q.data_ptr(), k_ptr, v_ptr, ks_ptr, vs_ptr, kv_quant.NATIVE_CODES[k_cache.dtype],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, h, kv_heads, d, block_size,
        num_blocks, scale, window or 0, out.data_ptr())
    build.raise_for(rc, "paged_decode_attention")
    return out


def prefill_attention_available(head_dim: int) -> bool:
    """Whether this build has paged_attention.c's prefill kernel for ``head_dim`` (AVX-512,
    a multiple of 16)."""
    return build.available() and bool(build.require().mw_prefill_attention_available(head_dim))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int, scale: float,
                            window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill chunk: q [Q, H, D] float32, the queries of positions
    seq_len - Q .. seq_len - 1 (their K/V already in the cache), attends causally over the
    blocks of ``block_table`` (int64 [width]) where they lie -> [Q, H, D]; ``window``: a
    sliding layer's, each query its last ``window`` keys. Bad shapes, lengths or block ids
    raise ValueError before C runs; a head_dim this build has no kernel for,
    NotImplementedError (prefill_attention_available says which). ``out``: a contiguous
    float32 [Q, H, D] to write into (returned), else a new tensor."""
    n, h, d = _check_attention(q, "Q", k_cache, v_cache, "paged_prefill_attention")
    (k_ptr, ks_ptr), (v_ptr, vs_ptr) = _cache_ptrs(k_cache), _cache_ptrs(v_cache)
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(n, h, d, dtype=torch.float32)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {list(q.shape)}, got {out.dtype} "
                         f"{list(out.shape)}")
    if n == 0:
        return out
    q = q.contiguous()
    table = _indices(block_table, "block_table", block_table.shape[0] if block_table.dim() else 0)
    rc = build.require().mw_paged_prefill_attention(
        q.data_ptr(), k_ptr, v_ptr, ks_ptr, vs_ptr, kv_quant.NATIVE_CODES[k_cache.dtype],
        table.data_ptr(), table.shape[0], int(seq_len), n, h, kv_heads, d, block_size, num_blocks,
        scale, window or 0, out.data_ptr())
    build.raise_for(rc, "paged_prefill_attention")
    return out


def kv_write(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """x [n, kv_heads, D] float32 -> the cache's slots in its format, through the C writer the
    fused decode step uses (kv_quant.write is its torch twin; tests hold them byte-equal)."""
    n, kv_heads, d = x.shape
    if cache.dim() != 4 or tuple(cache.shape[2:]) != (kv_heads, d):
        raise ValueError(f"x {list(x.shape)} does not fit a cache of {list(cache.shape)}")
    try:
        ptr, scales = _cache_ptrs(cache)
    except Unsupported as e:
        raise ValueError(f"kv_write cannot write {e}") from e
    x = x.float().contiguous()
    slots = _indices(slots, "slots", n)
    rc = build.require().mw_kv_write(
        x.data_ptr(), n, slots.data_ptr(), cache.shape[0] * cache.shape[1], kv_heads, d,
        kv_quant.NATIVE_CODES[cache.dtype], ptr, scales)
    build.raise_for(rc, "kv_write")
